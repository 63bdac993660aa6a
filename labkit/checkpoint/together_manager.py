"""What CheckpointManager does when several torchrun processes save and restore one checkpoint together: the
save's two halves (the training thread's, the writer thread's) and the restore as one decision. A part of
CheckpointManager (labkit.checkpoint.manager), in a file of its own: the manager reads in one sitting.

    manager.save(step, trainer.state_dict())   # under torchrun with DTensor shards: _save_together, on every process
    manager.restore(into=template)             # under torchrun: _restore_together, one plan from process 0
"""

from __future__ import annotations

import functools
import warnings

from labkit.checkpoint.state import ReadFailed, recorded_entries


class Refused(ValueError):
    """A resume refused on every process together (CheckpointManager.restore's check, under torchrun)."""


class Together:
    """CheckpointManager's methods for several processes (self is the manager)."""

    def _group(self):
        """The checkpoint's own gloo process group (labkit.checkpoint.together.checkpoint_group), made at the first
        save or restore under torchrun: every process reaches that point together."""
        if self._pg is None:
            from labkit.checkpoint.together import checkpoint_group

            self._pg = checkpoint_group()
        return self._pg

    def _save_together(self, fmt, step, state, metrics, best_value) -> bool:
        """Several processes, each holding its own shards. On the training thread: the previous save finished (at
        most one in flight), process 0's lock proved, one agreement, then DCP's async_save copies this process's
        shards to the CPU and returns (labkit.checkpoint.dcp's begin_together). In the writer's thread: DCP's write
        ends, each process stores its files, every process checks it sees them all, process 0 proves its lock,
        commits and prunes; every process then knows the outcome (a failure anywhere fails the save everywhere,
        nothing committed), on the next save(), wait() or close(). Its collectives run on a gloo group of the
        checkpoint's own, so they never interleave with the training's."""
        from labkit.checkpoint.together import agree

        self.writer.wait()
        group, err = self._group(), None
        if self._master:
            try:
                self.store.acquire_writer(takeover=self.restored is not None)
            except BaseException as e:
                err = e
        agree(self.rt, err, f"saving {self.store.url(fmt.name(step))}", group=group)
        if best_value is not None:
            self.best = {"step": step, "name": fmt.name(step), "value": best_value}
            self.best.update(metric=self.best_metric, mode=self.mode)
        best = dict(self.best or {})
        replace = lambda: self._may_replace(fmt, step)  # noqa: E731
        pending = fmt.begin_together(step, state, self.rt, group, replace, background=self.async_save)
        meta = {k: v for k, v in (metrics or {}).items() if isinstance(v, (int, float, str))}
        self.writer.submit(step, self._finish_together, fmt, pending, meta, best, group, recorded_entries(state))
        return True

    def _finish_together(self, fmt, pending, metrics, best, group, position=None) -> None:
        """In the writer's thread (every process): the files stored and seen by all, then process 0 commits and
        prunes. A prune that fails after a good commit is a warning on every process (the step is saved; the old
        steps stay until the next save's prune): raised on process 0 alone, it would fail its next save() while the
        others went on into that save's agreement."""
        from labkit.checkpoint.together import agree

        step = pending["step"]
        try:
            info = fmt.finish_together(pending, self.rt, group)
        except BaseException:
            if self._master:
                fmt.abort(step)
            raise
        err = entries = kept = None
        if self._master:
            try:
                self._mine.add(fmt.name(step))
                entries = self._entries()
                kept = self._retained(step, best, entries)
                self.writer.staged(step, fmt.name(step))  # every file stored, no marker yet: the commit point is next
                self.store.check_writer()  # the commit point: only while the lock is still ours
                fmt.commit(step, info, {"metrics": metrics, "best": best or None, "position": position}, kept)
            except BaseException as e:
                fmt.abort(step)
                err = e
        agree(self.rt, err, f"committing {self.store.url(fmt.name(step))}", group=group)
        said = None
        if self._master:
            try:
                self._prune(step, kept, entries)
            except Exception as e:
                said = f"{type(e).__name__}: {e}"
        said = agree(self.rt, None, f"pruning after {self.store.url(fmt.name(step))}", said, group=group)[0]
        if said:
            warnings.warn(
                f"{self.store.url(fmt.name(step))} is committed, but removing the steps it replaces failed on process "
                f"0 ({said}); they stay until the next save prunes them",
                stacklevel=2,
            )

    def _refused_together(self, check, where, group, position) -> None:
        """check(position) on every process, made one outcome before any process reads a tensor: a refusal on any
        process (its own data differs: a per-process dataset) is raised by all, as ValueError naming the process.
        One all_gather_object on the checkpoint's group."""
        from labkit.checkpoint.together import agree

        err = None
        try:
            check(position)
        except Exception as e:
            err = e
        why = agree(self.rt, None, f"resuming from {where}", None if err is None else str(err), group=group)
        refused = [(r, w) for r, w in enumerate(why) if w is not None]
        if refused:
            r, w = refused[0]
            raise Refused(f"{w} (process {r} of {self.rt.world_size}; every process refuses the resume)") from err

    def _candidates(self, step):
        """The steps a restore tries, in order: [(step, format kind, None or why it is uncommitted)], newest first, or
        only `step` (FileNotFoundError where it does not exist or did not finish). One listing of the store; under
        torchrun process 0's, broadcast (not one per process)."""
        entries = self._entries()
        if step is not None:
            found = [(s, f, c) for s, f, c in entries if s == step]
            if not found:
                fmt = self.formats["sharded" if self.format == "sharded" else "file"]
                raise FileNotFoundError(f"checkpoint {self.store.url(fmt.name(step))} does not exist")
            s, fmt, committed = max(found, key=lambda e: e[2])
            if not committed and fmt.unfinished(step):
                raise FileNotFoundError(f"checkpoint {self.store.url(fmt.name(step))}: {fmt.unfinished(step)}")
            return [(step, fmt.kind, None)]
        # newest first; an uncommitted step carries what restore says when it reaches it (a crash, a kill -9)
        return [(s, f.kind, None if c else f.unfinished(s) or "") for s, f, c in reversed(entries)]

    def _agreed(self, work):
        """work()'s answer, the same on every process: under torchrun process 0's (_from_master), else work()."""
        from labkit.torchrun import active

        if not active(self.rt):
            return work()
        return self._from_master(work)

    def _from_master(self, work):
        """work() on process 0, its result (or its error, by class name and text) on every process: one
        broadcast_object_list on the checkpoint's group. Process 0 raises its own error."""
        import torch.distributed as dist

        box = [None]
        if self._master:
            try:
                box[0] = ("ok", work())
            except Exception as e:
                box[0] = (type(e).__name__, str(e), e)
        payload = [box[0][:2] if box[0] and box[0][0] != "ok" else box[0]]
        try:
            dist.broadcast_object_list(payload, src=dist.get_global_rank(self._group(), 0), group=self._group())
        except Exception as e:  # the group's timeout, or process 0 gone: say what was waited for
            raise RuntimeError(
                f"reading {self.root}: waiting for process 0's answer failed ({type(e).__name__}: {e})"
            ) from e
        if payload[0][0] == "ok":
            return payload[0][1]
        if self._master:
            raise box[0][2]
        kind = {"FileNotFoundError": FileNotFoundError, "ReadFailed": ReadFailed}.get(payload[0][0], OSError)
        raise kind(f"on process 0: {payload[0][1]}")

    def _restore_together(self, step, into, map_location, check=None):
        """restore() under torchrun, as one decision: process 0 lists the steps and reads each commit record, the
        plan is broadcast; each process loads its own shards, checking only the files they read (their crc32c), and
        the verdicts are all-gathered (labkit.checkpoint.together.verdict): a damaged file on any process makes every
        process fall back to the same older step, the warning naming the file and the process; an unreachable
        store stops every process. Cost: 2 small collectives per step tried, on the checkpoint's gloo group."""
        from labkit.checkpoint.together import verdict

        group = self._group()
        plan = self._from_master(lambda: self._candidates(step))
        tried = []
        for s, kind, unfinished in plan:
            fmt = self.formats[kind]
            where = self.store.url(fmt.name(s))
            if unfinished is not None:  # a save that did not finish: skipped by every process alike
                if unfinished:
                    warnings.warn(f"ignoring {where}: {unfinished}", stacklevel=3)
                continue
            try:
                rec = self._from_master(functools.partial(fmt.marker, s)) if kind == "sharded" else None
            except ReadFailed:
                raise
            except OSError as e:  # an unreadable marker: uncommitted, on every process alike
                if step is not None:
                    raise
                warnings.warn(str(e), stacklevel=3)
                continue
            tried.append(fmt.name(s))
            err = state = record = None
            precheck = functools.partial(self._refused_together, check, where, group)
            try:
                state, record = self._read_checked(fmt, s, into, map_location, check, rec, precheck)
            except Refused:
                raise  # on every process alike, before any tensor was read
            except Exception as e:
                err = e
            bad = verdict(self.rt, err, f"restoring {where}", group)
            if bad is None:
                self.restored = record
                return state
            if step is not None or isinstance(bad, ReadFailed) or not fmt.damaged(bad):
                if bad is err:
                    raise bad
                raise bad from err
            warnings.warn(fmt.fallback_message(s, bad), stacklevel=3)
            self._damaged.add(fmt.name(s))
        if tried:
            raise RuntimeError(f"no readable checkpoint under {self.root} (tried {tried})")
        return None
