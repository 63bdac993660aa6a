"""Secrets out of everything labkit shows or stores: the one redaction for URLs and command lines.

    from labkit.redact import redact, redact_command
    redact("cannot read s3://KEY:SE/CR#ET@bucket/x?X-Amz-Signature=abc")  # 'cannot read s3://***@bucket/x?X-Amz-Signature=***'
    redact_command(["python", "train.py", "--token", "abc", "https://u:p@h/x"])  # 'python train.py --token *** https://***@h/x'

Standard library only and the lowest layer of labkit: every message, warning, log line and cache key that can
hold a URL or another process's command line goes through it (data_tools, labkit.cloud, labkit.envsetup; the
set-up cell loads this file by path beside envsetup.py). What it hides:
- user info, to the authority's last @: `https://user:pass@host`, `s3://KEY:SECRET@bucket`, `gs://user:TOKEN@b`,
  a password holding a raw `/`, `#`, `?`, `@` or `:` included (`u:pa/ss@host` -> `***@host`). A URL whose path
  holds an @ after a `host:port/` may lose more than its user info: shown too little, never too much.
- query values whose name holds token, sig(nature), secret, password, credential, key, auth or session
  (`X-Goog-Signature`, `X-Amz-Credential`, `X-Amz-Security-Token`, `access_token`, `key`, `Signature`, `sig`).
- in a command line, also the value of an option or a NAME=value whose name holds one of those words
  (`--api-key=...`, `--token abc`, `HF_TOKEN=...`).
"""

from __future__ import annotations

import re

SECRET_WORDS = ("token", "sig", "secret", "password", "passwd", "pwd", "credential", "key", "auth", "session")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_URL_END = re.compile(r"[\s'\"<>`]")  # a URL in a message ends at a space or a quote
# a value runs to the next & # or space; punctuation that ends a sentence or a quote after it stays ("...: failed")
_QUERY = re.compile(r"([?&;])([^=&#\s]*)=([^&#\s]*?)(?=[.,:;)'\"\]]*(?:[&#\s]|$))")
_WORDS = "|".join(SECRET_WORDS)
_OPTION = re.compile(rf"(?i)(--?[\w.-]*(?:{_WORDS})[\w.-]*)(=|\s+)(?!-)(\S+)")
_ASSIGN = re.compile(rf"(?i)(?<![\w-])([A-Za-z_][\w.]*(?:{_WORDS})[\w.]*)=(\S+)")


def _userinfo_end(rest: str) -> int:
    """In `rest` (what follows `scheme://`, up to the URL's end): the index of the @ that ends the user
    info, or -1 when there is none."""
    at = rest.find("@")
    if at < 0:
        return -1
    before = rest[:at]
    if any(c in before for c in "/?#") and ":" not in re.split(r"[/?#]", before, maxsplit=1)[0]:
        return -1  # `host/path@v2`: an @ in the path, no user info
    # the authority runs to the first / ? # after that @; its last @ ends the user info (a raw @ in a password)
    end = next((i for i in range(at + 1, len(rest)) if rest[i] in "/?#"), len(rest))
    return rest.rfind("@", 0, end)


def redact(text) -> str:
    """`text` with the secrets of every URL in it replaced by *** (see the module docstring); the rest is kept."""
    text, out, pos = str(text), [], 0
    while m := _SCHEME.search(text, pos):
        start = m.end()
        stop = _URL_END.search(text, start)
        stop = stop.start() if stop else len(text)
        at = _userinfo_end(text[start:stop])
        if at < 0:
            out.append(text[pos:start])
        else:
            out.append(text[pos:start] + "***")
            start += at
        pos = start
    text = "".join(out) + text[pos:]

    def query(m):
        hidden = any(w in m.group(2).lower() for w in SECRET_WORDS)
        return f"{m.group(1)}{m.group(2)}=***" if hidden and m.group(3) else m.group(0)

    return _QUERY.sub(query, text)


def redact_command(cmd) -> str:
    """A command line (a list of arguments, or one string) as text safe to show: its URLs through redact(),
    and the values of options and NAME=value assignments whose names hold a secret word hidden."""
    text = cmd if isinstance(cmd, str) else " ".join(str(c) for c in cmd)
    text = _OPTION.sub(lambda m: f"{m.group(1)}{m.group(2)}***", redact(text))
    return _ASSIGN.sub(lambda m: f"{m.group(1)}=***", text)
