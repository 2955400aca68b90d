"""The artifact store: one root (local folder or s3://bucket/prefix) over fsspec.

Contracts 1-3 (docs/extending.md, "The numbered contracts") live here. A stage writes under
`<root>/<stage>/<fingerprint>/`, where the fingerprint hashes the stage's
config sections, its inputs' manifest digests and the code version. Every
shard is written to a local temporary file, hashed, then committed in one step
(os.replace locally; one PUT on S3, which never exposes a partial object).
A stage is complete if and only if its `manifest.json` exists and verifies;
the manifest is written last. This module knows nothing of what shards hold.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from draftflow import __version__
from draftflow.contracts import Manifest, ShardEntry, check_manifest
from draftflow.errors import StoreError
from draftflow.kept import default_cache_dir

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"
# Shards up to this size are re-hashed when a stage is checked for reuse; bigger ones
# (feature shards, GBs) are checked by size there and by sha256 when a stage reads them.
SHA_ON_REUSE_MAX_BYTES = 64 << 20


def sha256_file(path: str | Path, fs=None) -> str:
    """sha256 of a file, streamed: a local path, or a path on the fsspec filesystem `fs`."""
    h = hashlib.sha256()
    with (fs.open(path, "rb") if fs is not None else open(path, "rb")) as fh:
        for chunk in iter(lambda: fh.read(8 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _read_umask() -> int:
    mask = os.umask(0)  # the only way to read it; done once, at import, before any thread writes
    os.umask(mask)
    return mask


_UMASK = _read_umask()


def shared_mode(directory: bool = False) -> int:
    """The mode a plain new file (or folder) gets under the process's umask: 0644 (0755) under 022."""
    return (0o777 if directory else 0o666) & ~_UMASK


def write_local_atomic(path: str | Path, write) -> None:
    """`write(tmp)` to a temporary name beside `path`, then rename over it: whole or absent."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with writer_errors(tmp):
            write(tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how Rust's std::io::Error ends (safetensors)
NEARLY_FULL_BYTES = 1 << 20


@contextmanager
def writer_errors(path: str | Path) -> Iterator[None]:
    """Turn a writer library's own error for a refused write into the OSError it is, naming `path`.

    safetensors says "I/O error: No space left on device (os error 28)" in a SafetensorError; torch.save
    says "PytorchStreamWriter failed writing file" in a RuntimeError, with no cause (then: a device with
    under NEARLY_FULL_BYTES free is taken as full). Other errors pass through unchanged.
    """
    try:
        yield
    except OSError:
        raise
    except Exception as exc:
        found = _RUST_OS_ERROR.search(str(exc))
        code = int(found.group(1)) if found else errno.ENOSPC if _nearly_full(Path(path)) else None
        if code is None:
            raise
        raise OSError(code, os.strerror(code), str(path)) from exc


def _nearly_full(path: Path) -> bool:
    near = next((p for p in (path, *path.parents) if p.exists()), None)
    try:
        return near is not None and shutil.disk_usage(near).free < NEARLY_FULL_BYTES
    except OSError:
        return False


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def digest(obj: Any) -> str:
    """sha256 hex of an object's canonical JSON."""
    return hashlib.sha256(canonical_json(obj)).hexdigest()


def code_version(stage: str | None = None) -> str:
    """The package version plus a hash of the library source a stage depends on.

    With a stage: its module and everything it imports (`draftflow.codehash`), so an edit
    to the trainer never recomputes curation or features. Without: every source file.
    Conservative (a comment change recomputes the stages that import it) but never stale.
    """
    from draftflow.codehash import library_hash, stage_code_hash

    return f"{__version__}+{stage_code_hash(stage) if stage else library_hash()}"


def stage_fingerprint(stage: str, sections: dict[str, Any], inputs: dict[str, str]) -> str:
    """Contract 1: hash of (config sections, input manifest digests, the stage's code version)."""
    return digest({"stage": stage, "config": sections, "inputs": inputs, "code": code_version(stage)})[:16]


class Store:
    """Paths, atomic writes and manifests under one run root."""

    def __init__(self, root: str):
        self.root = root
        self.fs, base = fsspec.core.url_to_fs(root)
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self.base = os.path.abspath(base) if self.is_local else base.rstrip("/")

    # -- paths ---------------------------------------------------------------
    def path(self, *parts: str) -> str:
        return "/".join([self.base, *parts])

    def url(self, path: str) -> str:
        """A path as the user should see it (s3://… for S3)."""
        return path if self.is_local else self.fs.unstrip_protocol(path)

    def stage_path(self, stage: str, fingerprint: str, *parts: str) -> str:
        return self.path(stage, fingerprint, *parts)

    def exists(self, path: str) -> bool:
        return self.fs.exists(path)

    # -- writing -------------------------------------------------------------
    @contextmanager
    def writing(self, dest: str) -> Iterator[str]:
        """Yield a local temp path; on success commit it to `dest` atomically.

        On an exception the temp file is removed and `dest` is untouched.
        """
        if self.is_local:
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(dest)}.", suffix=".tmp", dir=os.path.dirname(dest))
        else:
            fd, tmp = tempfile.mkstemp(suffix=".tmp")
        os.close(fd)
        try:
            yield tmp
            self._commit(tmp, dest)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    def _commit(self, tmp: str, dest: str) -> None:
        if self.is_local:
            os.chmod(tmp, shared_mode())  # mkstemp makes 0600: a serving job or a teammate must read runs
            os.replace(tmp, dest)
        else:
            self.fs.put_file(tmp, dest)  # one PUT: the object appears whole or not at all

    def write_bytes(self, dest: str, data: bytes) -> None:
        with self.writing(dest) as tmp:
            Path(tmp).write_bytes(data)

    def write_json(self, dest: str, obj: Any) -> None:
        self.write_bytes(dest, json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False).encode())

    # -- reading -------------------------------------------------------------
    def read_json(self, path: str) -> Any:
        with self.fs.open(path, "rb") as fh:
            return json.loads(fh.read())

    def local_path(self, path: str, sha256: str | None = None) -> str:
        """A local file with the content of `path` (S3 objects are downloaded once).

        With `sha256` the local copy is keyed by content, so a rewritten object is
        fetched again instead of being served from a stale copy.
        """
        if self.is_local:
            return path
        cache = default_cache_dir() / "store"
        key = hashlib.sha256(f"{path}\0{sha256 or ''}".encode()).hexdigest()[:24]
        local = cache / key / os.path.basename(path)
        if not local.exists():
            local.parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(path, str(local) + ".part")
            os.replace(str(local) + ".part", local)
        return str(local)

    # -- manifests -----------------------------------------------------------
    def write_manifest(self, stage: str, fingerprint: str, manifest: Manifest) -> Manifest:
        """Verify every listed shard, then write the manifest (always last)."""
        for shard in manifest.shards + manifest.rejected:
            self._check_shard(stage, fingerprint, shard)
        self.write_json(self.stage_path(stage, fingerprint, MANIFEST), manifest.to_json())
        return manifest

    def read_manifest(self, stage: str, fingerprint: str) -> Manifest | None:
        """The stage's manifest if the stage is complete, else None."""
        path = self.stage_path(stage, fingerprint, MANIFEST)
        if not self.exists(path):
            return None
        try:
            manifest = check_manifest(self.read_json(path), self.url(path))
        except ValueError:  # not JSON (a torn or foreign file): recomputed, never returned
            log.warning("%s is not JSON; the stage will be recomputed", self.url(path))
            return None
        if manifest is None:
            return None
        try:  # shards, and the files a stage lists in `extra.files` (train: drafter, exports, metrics)
            for shard in (*manifest.shards, *manifest.rejected, *listed_files(manifest)):
                self._check_shard(stage, fingerprint, shard)
        except StoreError as exc:
            log.warning("%s: %s; the stage will be recomputed", stage, exc)
            return None
        return manifest

    def _check_shard(self, stage: str, fingerprint: str, shard: ShardEntry) -> None:
        path = self.stage_path(stage, fingerprint, shard.name)
        if not self.exists(path):
            raise StoreError(f"shard {self.url(path)} is missing")
        size = self.fs.size(path)
        if size != shard.bytes:
            raise StoreError(f"shard {self.url(path)} has {size} bytes, manifest says {shard.bytes}")
        if size <= SHA_ON_REUSE_MAX_BYTES and self.is_local and sha256_file(path) != shard.sha256:
            raise StoreError(f"shard {self.url(path)} fails its checksum")

    def sha_matches(self, stage: str, fingerprint: str, shard: ShardEntry) -> bool:
        """Whether the committed shard's bytes still have its manifest entry's sha256 (streamed, no copy)."""
        return sha256_file(self.stage_path(stage, fingerprint, shard.name), self.fs) == shard.sha256

    def verify_sha(self, stage: str, fingerprint: str, shard: ShardEntry) -> str:
        """Local path of a shard whose sha256 matches its manifest entry."""
        local = self.local_path(self.stage_path(stage, fingerprint, shard.name), shard.sha256)
        if sha256_file(local) != shard.sha256:
            raise StoreError(f"shard {shard.name} of {stage} fails its checksum; delete it and re-run")
        return local


def listed_files(manifest: Manifest) -> list[ShardEntry]:
    """The entries of `manifest.extra["files"]` (files a stage wrote beside its shards, e.g. exports)."""
    return [ShardEntry.model_validate(f) for f in (manifest.extra or {}).get("files", [])]


def shard_entry(name: str, local_file: str, rows: int, tokens: int = 0, **extra: Any) -> ShardEntry:
    """The manifest entry of a shard about to be committed from `local_file` (`extra`: the stage's own
    fields, e.g. `split`)."""
    return ShardEntry(name=name, rows=rows, tokens=tokens, bytes=os.path.getsize(local_file),
                      sha256=sha256_file(local_file), **extra)


# ----------------------------------------------------------------------------- storage errors

_ERRNO_CAUSES = {errno.ENOSPC: "no_space", errno.EDQUOT: "no_space", errno.EFBIG: "no_space",
                 errno.EACCES: "permission", errno.EPERM: "permission", errno.EROFS: "permission",
                 errno.ENOENT: "not_found", errno.ENOTDIR: "not_found", errno.EISDIR: "not_found",
                 errno.ECONNREFUSED: "endpoint", errno.EHOSTUNREACH: "endpoint", errno.ENETUNREACH: "endpoint"}
_CREDENTIAL_WORDS = ("credentials", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
                     "InvalidToken", "TokenRefreshRequired", "Access Key Id you provided does not exist",
                     "request signature we calculated does not match", "security token included in the request is")
_ENDPOINT_WORDS = ("Could not connect to the endpoint", "EndpointConnectionError", "Invalid endpoint",
                   "Name or service not known", "nodename nor servname")
# Causes a retry cannot fix: the user must act (free space, permissions, credentials). A file not found
# mid-stage is left retryable: there it is more often a race (a shard removed under a cached task) than a typo.
USER_CAUSES = {"no_space", "permission", "credentials"}


def _causes(exc: BaseException) -> list[BaseException]:
    """`exc` and the exceptions it was raised from (`__cause__`, else `__context__`), outermost first."""
    chain: list[BaseException] = []
    while exc is not None and exc not in chain and len(chain) < 8:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    return chain


def storage_cause(exc: BaseException) -> str | None:
    """Why storage refused: "no_space", "permission", "not_found", "credentials", "endpoint", or None.

    Reads the errno of an OSError (local files; s3fs maps S3's AccessDenied/NoSuchKey to them),
    else botocore's exception names and error codes (which are not OSErrors). None: unclassified.
    """
    chain = _causes(exc)  # s3fs raises PermissionError from botocore's ClientError: the code S3 sent is in the cause
    names = {c.__name__ for e in chain for c in type(e).__mro__}
    text = " ".join(f"{type(e).__name__}: {e}" for e in chain)
    if names & {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"} or any(
            w in text for w in _CREDENTIAL_WORDS):
        return "credentials"
    if names & {"EndpointConnectionError", "ConnectTimeoutError", "InvalidEndpointConfigurationError"} or any(
            w in text for w in _ENDPOINT_WORDS):
        return "endpoint"
    code = next((c for e in chain if (c := (getattr(e, "response", None) or {}).get("Error", {}).get("Code"))),
                None)  # botocore ClientError
    if code in ("AccessDenied", "403", "AllAccessDisabled"):
        return "permission"
    if code in ("NoSuchBucket", "NoSuchKey", "404"):
        return "not_found"
    if isinstance(exc, OSError):
        return _ERRNO_CAUSES.get(exc.errno or 0) or ("permission" if isinstance(exc, PermissionError) else
                                                    "not_found" if isinstance(exc, FileNotFoundError) else None)
    found = _RUST_OS_ERROR.search(str(exc))  # a writer's own exception around an OS error (safetensors)
    return _ERRNO_CAUSES.get(int(found.group(1))) if found else None


_HINTS = {
    "no_space": "the device is full; free space there or move root (extract.force=true only skips the space "
                "estimate; extract.dtype=float8 or extract.mode=online need less)",
    "permission": "permission denied; make it writable by this user or choose another root (s3://: the "
                  "bucket's policy must allow it)",
    "not_found": "it does not exist; check the path (root, curate.sources[].path, target.path) and, for s3://, "
                 "the bucket name",
    "credentials": "the credentials were refused or are missing (S3 does not know the access key, or the secret "
                   "or token does not match it); for s3:// set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or "
                   "AWS_PROFILE) in the environment to a key the endpoint knows",
    "endpoint": "the endpoint cannot be reached; check AWS_ENDPOINT_URL (or the network) for s3://",
}
_UNKNOWN_HINT = "check the path and, for s3://, the AWS credentials and AWS_ENDPOINT_URL"


def storage_error_message(exc: BaseException, where: str | None = None) -> str:
    """One line for a storage error naming the file, its hint chosen by `storage_cause`."""
    where = where or getattr(exc, "filename", None) or "the run root or a source"
    detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    detail = " ".join(f"{type(exc).__name__}: {detail}".split())
    cause = storage_cause(exc)
    head = "storage refused the request for" if cause in ("credentials", "endpoint") else "cannot access"
    return f"{head} {where} ({detail}); {_HINTS.get(cause or '', _UNKNOWN_HINT)}"
