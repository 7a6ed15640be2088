"""The output of an offline batch: a JSON-lines file that survives being killed, and that a rerun resumes.

Each write is whole lines in one write() on a file opened for appending, then fsync: once write_lines returns,
its lines are on disk, and a crash can only cut the last line short. On opening, a last line without its
newline (such a cut) is truncated away, and the ids of the whole lines before it are the requests already done.
"""

import json
import os
from pathlib import Path

from hybridjit.serving.batch_requests import id_key


class ResumableOutput:
    """OUT, opened for appending: `done` maps the key (batch_requests.id_key) of each id already written to its
    line's record; `truncated` is the bytes of a torn last line removed on opening (0: none)."""

    def __init__(self, path):
        self.path = Path(path)
        self.done: dict[str, dict] = {}
        self.truncated = 0
        if self.path.exists():
            self._recover()
        created = not self.path.exists()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if created:  # the new file's directory entry must survive a crash too
            directory = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)

    def _recover(self):
        data = self.path.read_bytes()
        whole = data.rfind(b"\n") + 1
        if whole < len(data):
            os.truncate(self.path, whole)
            self.truncated = len(data) - whole
        for number, line in enumerate(data[:whole].splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                key = id_key(record["id"])
            except (ValueError, TypeError, KeyError):
                raise ValueError(
                    f"{self.path} line {number}: not an output line of hybridjit batch (a JSON object with an id); "
                    "give another output file"
                ) from None
            self.done[key] = record

    def write_lines(self, records: list[dict]):
        """Appends one line per record, durably (see the module's docstring)."""
        if not records:
            return
        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
        view = memoryview(data)
        while view:  # write() may take less than all on some filesystems
            view = view[os.write(self._fd, view) :]
        os.fsync(self._fd)
        for record in records:
            self.done[id_key(record["id"])] = record

    def close(self):
        os.close(self._fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
