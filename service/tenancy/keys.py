"""The keys file: tenants, their hashed API keys and their limits.

```yaml
tenants:
  team-a:
    keys: ["sha256:9f86d081..."]      # sha256 of each key, never the key itself
    models: ["*"]                      # served model names or LoRA adapter names; "*": all
    requests_per_minute: 600
    tokens_per_minute: 200000          # prompt + completion, counted as they are generated
    max_concurrency: 16                # requests in flight at once, across replicas
    priority: 0                        # the default `priority` of its requests (lower: sooner)
```

JSON works too. A Kubernetes Secret mounted as a file is read the same way; Kubernetes swaps the
file when the Secret changes, and `KeyTable` reloads it (checked at most once a second). A file
that no longer parses keeps the last good table and logs why. `python -m service.tenancy.keys`
prints a new key and the hash to put in the file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, field_validator

logger = logging.getLogger(__name__)

HASH_PREFIX = "sha256:"
MAX_TENANTS = 256  # also bounds the `tenant` label of the per-tenant metrics
TENANT_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
KEY_HASH = r"^sha256:[0-9a-f]{64}$"


def hash_key(key: str | bytes) -> str:
    """What the keys file stores for `key`: `sha256:` and the hex digest."""
    raw = key.encode() if isinstance(key, str) else key
    return HASH_PREFIX + hashlib.sha256(raw).hexdigest()


class TenantSpec(BaseModel):
    """One tenant as the file writes it; a limit left out (or null) is no limit."""

    model_config = ConfigDict(extra="forbid")

    keys: Annotated[list[Annotated[str, StringConstraints(pattern=KEY_HASH)]], Field(min_length=1)]
    models: Annotated[list[Annotated[str, StringConstraints(min_length=1)]], Field(min_length=1)] = ["*"]
    requests_per_minute: Annotated[int, Field(ge=1)] | None = None
    tokens_per_minute: Annotated[int, Field(ge=1)] | None = None
    max_concurrency: Annotated[int, Field(ge=1)] | None = None
    priority: Annotated[int, Field(ge=-1_000_000, le=1_000_000)] = 0


class KeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenants: Annotated[dict[Annotated[str, StringConstraints(pattern=TENANT_NAME)], TenantSpec],
                       Field(min_length=1, max_length=MAX_TENANTS)]

    @field_validator("tenants")
    @classmethod
    def _keys_unique(cls, tenants: dict[str, TenantSpec]) -> dict[str, TenantSpec]:
        owner: dict[str, str] = {}
        for name, spec in tenants.items():
            for h in spec.keys:
                if owner.setdefault(h, name) != name:
                    raise ValueError(f"the key hash {h[:15]}... is listed under both {owner[h]!r} and {name!r}")
        return tenants


@dataclass(frozen=True)
class Limits:
    """A tenant's limits as the ledger enforces them (None: no limit)."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrency: int | None = None

    @property
    def unlimited(self) -> bool:
        return self.requests_per_minute is None and self.tokens_per_minute is None and self.max_concurrency is None


@dataclass(frozen=True)
class Tenant:
    name: str
    models: frozenset[str]  # {"*"}: every model
    limits: Limits
    priority: int = 0

    def allows(self, model: str) -> bool:
        return "*" in self.models or model in self.models


def parse_keys(text: str, where: str = "the keys file") -> dict[str, Tenant]:
    """The tenants of a keys file's text (YAML or JSON), by key hash; ValueError saying what is wrong."""
    try:
        raw: Any = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{where} is not YAML or JSON: {exc}") from None
    try:
        doc = KeysFile.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'the file'}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"{where}: {problems}") from None
    table = {}
    for name, spec in doc.tenants.items():
        tenant = Tenant(name, frozenset(spec.models), Limits(spec.requests_per_minute, spec.tokens_per_minute,
                                                            spec.max_concurrency), spec.priority)
        table.update(dict.fromkeys(spec.keys, tenant))
    return table


class KeyTable:
    """The tenants of the keys file at `path`, looked up by key; the file is read again when it
    changes (checked at most every `reload_interval_s`). Raises at construction when the file
    is missing or invalid: a service does not start without its keys."""

    def __init__(self, path: str | os.PathLike[str], reload_interval_s: float = 1.0) -> None:
        self.path = Path(path)
        self.reload_interval_s = reload_interval_s
        self.reloads = 0  # successful reloads after the first read
        self.reload_errors = 0
        self._lock = threading.Lock()
        self._checked = time.monotonic()
        self._stamp = self._file_stamp()
        self._table = parse_keys(self._read(), str(self.path))
        logger.info("keys file %s: %d tenants", self.path, len(self.tenants()))

    def _read(self) -> str:
        try:
            return self.path.read_text()
        except OSError as exc:
            raise ValueError(f"cannot read the keys file {self.path}: {exc.strerror or exc}") from None

    def _file_stamp(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)  # follows a Secret volume's symlinks to the current file
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def tenants(self) -> list[str]:
        return sorted({t.name for t in self._table.values()})

    def tenant(self, name: str) -> Tenant | None:
        """The tenant called `name` as the file says now, or None (no longer in it)."""
        self._maybe_reload()
        return next((t for t in self._table.values() if t.name == name), None)

    def lookup(self, key: str | bytes) -> Tenant | None:
        """The tenant `key` belongs to, or None."""
        self._maybe_reload()
        return self._table.get(hash_key(key))

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now - self._checked < self.reload_interval_s:
            return
        with self._lock:
            self._checked = now
            stamp = self._file_stamp()
            if stamp is None or stamp == self._stamp:
                return  # a missing file (mid-swap) keeps the table
            self._stamp = stamp
            try:
                self._table = parse_keys(self._read(), str(self.path))
            except ValueError as exc:
                self.reload_errors += 1
                logger.warning("keeping the previous keys: %s", exc)
                return
            self.reloads += 1
            logger.info("keys file %s reloaded: %d tenants", self.path, len(self.tenants()))


def main() -> None:
    ap = argparse.ArgumentParser(description="Make an API key and the hash a keys file stores for it "
                                             "(or hash a key given on stdin with --stdin).")
    ap.add_argument("--stdin", action="store_true", help="hash the key read from stdin instead of making one")
    args = ap.parse_args()
    if args.stdin:
        import sys

        print(hash_key(sys.stdin.read().strip()))
        return
    key = "qkv-" + secrets.token_urlsafe(32)
    print(json.dumps({"key": key, "hash": hash_key(key)}, indent=2))


if __name__ == "__main__":
    main()
