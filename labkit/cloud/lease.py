"""The writer lock of an object store (gs://, s3://), written once: one lock object, `.writer.lock`, per root.

A store that mixes in ObjectLock supplies five conditional operations on that one object, each answering None
where the object store said "not there" or "not that version" (a 404, a 412):

    _lock_create(body) -> version | None          create-only (gs: if_generation_match=0; s3: If-None-Match: *)
    _lock_read() -> (bytes, version, age_s) | None  the body, its version, its age on the server's clock
    _lock_version() -> version | None             metadata only
    _lock_replace(body, version) -> version | None  overwrite exactly that version (gs: generation; s3: ETag)
    _lock_delete(version) -> None                 delete exactly that version; quiet when it changed or went

and `_rm_hint`, the command that removes the object by hand. The rules live here: take it create-only before the
first byte; take over a lock that this run resumed, whose lease ran out on the server's clock, or whose pid on this
host is dead (a conditional overwrite of the version looked at: of two runs taking one lock over, one wins); before
every commit point prove it is still ours (no grace window), renewing it at most once a minute; release it only
while it is ours. The lease length is the store module's LEASE_S, passed in (so each store's can be set).
"""

from __future__ import annotations

import json
import time
import warnings

from labkit.cloud.store import LOCK, _holder, _pid_alive

RENEW_S = 60  # a held lock is rewritten (its age then says the writer lives) at most this often


class ObjectLock:
    _lock: dict | None = None  # our lock object's body while we hold it
    _lock_at = None  # the version we wrote (gs: a generation; s3: an ETag)
    _renewed = 0.0  # time.monotonic() of our last write of it
    _rm_hint = "remove it"

    def _hold(self, me: dict, version) -> None:
        self._lock, self._lock_at, self._renewed = me, version, time.monotonic()

    def _read_lock(self):
        """(body, version, age_s) of the lock object, or None when there is none. A body that is not a JSON
        object is refused by name: it is no lock labkit wrote."""
        found = self._lock_read()
        if found is None:
            return None
        data, version, age = found
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            body = None
        if not isinstance(body, dict):
            raise RuntimeError(
                f"{self.url(LOCK)} is not a labkit writer lock (its body is {data[:80]!r}, not a JSON object): "
                f"{self._rm_hint} {self.url(LOCK)}` once no run writes to {self.root}"
            )
        return body, version, max(0.0, age)

    def _acquire(self, takeover: bool, lease_s: float) -> None:
        """acquire_writer: see the module docstring. takeover=True: this run resumed the root, so the old run
        is over; its lock is replaced with a warning."""
        if self._lock is not None:  # held: each commit point of the save proves it (check_writer)
            return
        me = _holder()
        body = json.dumps(me).encode()
        for _ in range(5):
            version = self._lock_create(body)  # a retry after our own lost success reads back our id below
            if version is not None:
                return self._hold(me, version)
            found = self._read_lock()
            if found is None:
                continue  # released meanwhile: try again
            held, version, age = found
            if held.get("id") == me["id"]:
                return self._hold(me, version)
            dead = held.get("host") == me["host"] and isinstance(held.get("pid"), int) and not _pid_alive(held["pid"])
            if not (dead or age >= lease_s or takeover):
                raise RuntimeError(
                    f"{self.root} is being written by another checkpoint writer (host {held.get('host')} pid "
                    f"{held.get('pid')}, lock renewed {age / 60:.0f} min ago); two runs saving to one prefix would "
                    f"overwrite each other's checkpoints. Use another prefix, close() the other manager, or resume "
                    f"this run (TrainConfig.resume=True) to take over; a lock not renewed for {lease_s // 60:.0f} "
                    "min is taken over by itself"
                )
            version = self._lock_replace(body, version)  # exactly the lock looked at; None: another run changed it
            if version is None:
                continue
            if not dead:
                why = "this run resumed it" if takeover else f"not renewed for {age / 60:.0f} min"
                warnings.warn(
                    f"{self.url(LOCK)}: taking over the writer lock of host {held.get('host')} pid "
                    f"{held.get('pid')} ({why})",
                    stacklevel=4,
                )
            return self._hold(me, version)
        raise RuntimeError(f"could not take the writer lock {self.url(LOCK)} (other writers kept changing it)")

    def _check(self, lease_s: float) -> None:
        """check_writer: the lock's version must be the one we wrote, else RuntimeError and nothing is
        committed. Cost: one metadata read per commit point, and a rewrite at most once a minute."""
        if self._lock is None:
            raise RuntimeError(f"{self.url(LOCK)}: this writer does not hold the lock (released, or taken over)")
        ours = self._lock_version() == self._lock_at
        if ours and time.monotonic() - self._renewed >= RENEW_S:  # the renewal: its age then says we are alive
            version = self._lock_replace(json.dumps(self._lock).encode(), self._lock_at)
            ours = version is not None
            if ours:
                self._hold(self._lock, version)
        if not ours:
            self._lock = None
            raise RuntimeError(
                f"{self.url(LOCK)} was taken over by another writer (a resumed run, this one silent for "
                f"{lease_s // 60:.0f} min, or the lock deleted by hand): this run stops saving here rather than "
                "overwrite its checkpoints"
            )

    def release_writer(self) -> None:
        """Delete the lock only while it is still ours (a conditional delete of the version we wrote); a lock
        another run took over stays, with a warning."""
        if self._lock is None:
            return
        try:
            self.check_writer()
        except RuntimeError as e:
            warnings.warn(f"{e} (left in place)", stacklevel=3)
            return
        self._lock = None
        self._lock_delete(self._lock_at)
