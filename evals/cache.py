"""Per-sample results on disk: one JSON Lines file per configuration and task.

Each line is one finished sample, keyed by document id + prompt hash + configuration fingerprint,
appended and fsynced as soon as its chunk finishes. A rerun loads the file, skips every key it holds
and computes only the rest; lines of another fingerprint (a changed model, dtype, layout...) are
ignored, and a line cut short by a kill is removed from the file and reported (its sample runs again).
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

CACHE_VERSION = 5   # 2: the serving engine (KV cache, decode steps) replaced full-forward generation;
#                     3: reference solutions teacher-forced as whole lines within samples.GOLD_TOKENS;
#                     4: reference-token log-probabilities stored unrounded (the tolerance test);
#                     5: the fingerprint holds the engine kind's own options (evals/engines), not a fixed list


def sha256_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


SMALL_FILE = 64 << 20


def _file_identity(f: Path) -> list:
    st = f.stat()
    if st.st_size <= SMALL_FILE:  # fixtures: content, so a deterministic rebuild keeps the cache
        return [st.st_size, hashlib.sha256(f.read_bytes()).hexdigest()]
    return [st.st_size, st.st_mtime_ns]  # real checkpoints: too big to hash on every run


def _model_identity(path: str | None) -> dict:
    """Content of a model directory's small files, size and mtime of its large ones."""
    if not path or not Path(path).is_dir():
        return {"id": path}
    root = Path(path)
    return {"path": str(root), "files": {f.name: _file_identity(f) for f in sorted(root.iterdir())
                                         if f.is_file()}}


def fingerprint(config, max_gen_toks: int) -> str:
    """What determines a configuration's answers (not its port or log file)."""
    return sha256_json({
        "v": CACHE_VERSION, "name": config.name, "engine": config.engine,
        "layout": [config.tp, config.dp, config.ep], "dtype": config.dtype,
        "model": _model_identity(config.model_path), "tokenizer": config.tokenizer,
        "max_gen_toks": int(max_gen_toks), "replica": config.replica,
        "options": config.options.identity(),     # the engine kind's own keys (evals/engines)
    })[:16]


def safe_name(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "._=+-" else "_" for ch in name)


class SampleCache:
    def __init__(self, root: Path | str, config_name: str, task: str, fingerprint: str) -> None:
        self.path = Path(root) / "cache" / safe_name(config_name) / f"{task}.jsonl"
        self.fingerprint = fingerprint
        self.records: dict[tuple[str, str], dict] = {}
        self.stale = 0
        self.torn = 0
        self._load()

    @staticmethod
    def key(doc_id: str, prompt_hash: str) -> tuple[str, str]:
        return (doc_id, prompt_hash)

    def _load(self) -> None:
        if not self.path.is_file():
            return
        kept: list[str] = []
        with open(self.path, encoding="utf-8") as fh:
            for line in fh:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    self.torn += 1   # a line cut short by a kill
                    continue
                kept.append(line if line.endswith("\n") else line + "\n")
                if not isinstance(row, dict) or "record" not in row:
                    continue
                if row.get("fingerprint") != self.fingerprint:
                    self.stale += 1
                    continue
                self.records[self.key(row["doc_id"], row["prompt_hash"])] = row["record"]
        if self.torn:   # repaired, and said: the samples on a torn line run again
            tmp = self.path.with_suffix(".repair")
            tmp.write_text("".join(kept), encoding="utf-8")
            os.replace(tmp, self.path)
            print(f"cache {self.path}: removed {self.torn} line(s) cut short by an interrupted write; "
                  "their samples run again", file=sys.stderr)

    def get(self, doc_id: str, prompt_hash: str) -> dict | None:
        return self.records.get(self.key(doc_id, prompt_hash))

    def __contains__(self, key: tuple[str, str]) -> bool:
        return key in self.records

    def append(self, records: list[dict]) -> None:
        """Append finished samples durably (flush + fsync) before anything else happens."""
        if not records:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as fh:
            # a previous kill may have left a partial last line: start on a fresh line
            if fh.tell() > 0:
                with open(self.path, "rb") as rb:
                    rb.seek(-1, os.SEEK_END)
                    if rb.read(1) != b"\n":
                        fh.write("\n")
            for rec in records:
                row = {"doc_id": rec["doc_id"], "prompt_hash": rec["prompt_hash"],
                       "fingerprint": self.fingerprint, "record": rec}
                fh.write(json.dumps(row, ensure_ascii=False) + "\n")
                self.records[self.key(rec["doc_id"], rec["prompt_hash"])] = rec
            fh.flush()
            os.fsync(fh.fileno())


class ServingStats:
    """What the in-process serving engine's steps exercised for one configuration and task (steps, decode
    steps, steps with an idle DP rank, in MAX_LEN padding, ...), summed over every run that added samples to
    the cache: a resumed run adds its own steps. Written whole and renamed into place (never torn)."""

    def __init__(self, root: Path | str, config_name: str, task: str, fingerprint: str) -> None:
        self.path = Path(root) / "cache" / safe_name(config_name) / f"{task}.serving.json"
        self.fingerprint = fingerprint

    def load(self) -> dict[str, int]:
        try:
            row = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return dict(row.get("counts", {})) if row.get("fingerprint") == self.fingerprint else {}

    def add(self, delta: dict[str, int]) -> None:
        if not any(delta.values()):
            return
        counts = self.load()
        for k, v in delta.items():
            counts[k] = counts.get(k, 0) + int(v)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"fingerprint": self.fingerprint, "counts": counts}))
        os.replace(tmp, self.path)
