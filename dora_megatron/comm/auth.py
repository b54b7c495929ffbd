"""The job's credential: one secret per job, asked for by every server the job starts.

WHY: a job's processes talk over HTTP, and under SLURM they listen on the cluster network (on a
shared login node, loopback is shared too). Without a credential anyone who can reach a port can
load or replace the policy's weights, use or stop the rollout, or make the trainer
write and load checkpoints where they say. One secret per job, made at start and kept in the run
directory (0600), closes that: every server asks for ``Authorization: Bearer <secret>``, compared
in constant time; only ``/health`` stays open (and says nothing but health).

How the secret travels: the launcher puts it in :data:`SECRET_ENV` of the processes it starts
(never on a command line, where ``ps`` shows it to every user of the node); each server reads it
from there, each client (:class:`~dora_megatron.comm.http_session.HttpSession`) sends it.

Auth levels mirror SGLang 0.5.23 (``sglang/srt/utils/auth.py``): a server has an ``api_key`` (every
route) and an optional ``admin_api_key`` (the admin routes: weight updates, pause/continue, flush,
abort...). A normal route needs ``api_key`` when one is set; an admin route needs ``admin_api_key``
when one is set, else ``api_key``. Unlike SGLang (401 for both), a missing credential answers 401
and a wrong one 403, so a caller's log tells "forgot the header" from "wrong job".
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator, Mapping

if TYPE_CHECKING:
    from aiohttp.typedefs import Handler, Middleware
    from aiohttp.web import StreamResponse

#: the environment variable that hands the job's secret to the processes the job starts
SECRET_ENV = "DORA_JOB_SECRET"
#: the run directory's weight snapshots, where a job's engines may load weights from besides their model
WEIGHTS_ROOT_ENV = "DORA_WEIGHTS_ROOT"
#: vLLM's own variable for its ``--api-key`` (``vllm/envs.py``): a vLLM server of the job reads it
VLLM_KEY_ENV = "VLLM_API_KEY"
#: a YAML file (0600) SGLang reads its keys from (``--config``: its keys stay off the command line)
SGLANG_KEYS_ENV = "DORA_SGLANG_KEYS"
SGLANG_KEYS_FILE = "sglang-keys.yaml"
#: the secret's file in the run directory (mode 0600)
SECRET_FILE = "secret"
#: bytes of randomness in a made secret (256 bits)
SECRET_BYTES = 32
#: a user's own secret (``launch.secret_file``) is refused below this many characters
MIN_SECRET_CHARS = 32
#: paths answered without a credential (SGLang leaves ``/health*`` open for probes as well)
OPEN_PATHS = frozenset({"/health", "/health_generate"})


class SecretError(ValueError):
    """A secret file that cannot be used; the message names the file and why."""


def new_secret() -> str:
    """A fresh secret: :data:`SECRET_BYTES` random bytes from :mod:`secrets`, URL-safe text.

    WHY never a leading ``-``: SGLang reads its keys file into ``--api-key <secret>``, and its
    argument parser takes a value starting with ``-`` for a flag ("expected one argument"), so one
    job in 64 could not start its servers. Drawing again keeps 256 bits less one choice of 64."""
    while (secret := secrets.token_urlsafe(SECRET_BYTES)).startswith("-"):
        pass
    return secret


def write_secret(path: Path, secret: str) -> None:
    """Write ``secret`` to a new file readable by its owner only (created 0600, never widened).

    WHY a private file linked into place: the nodes of a SLURM job start at once, and a node that
    reads the shared run directory must see the whole secret or none (``link`` is atomic, also on
    NFS); FileExistsError when another process made it first."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(secret + "\n")
        os.link(tmp, path)
    finally:
        tmp.unlink()


def read_secret(path: Path) -> str:
    """The secret in ``path``; refused when others may read the file or the secret is too short."""
    try:
        mode = path.stat().st_mode
        text = path.read_text().strip()
    except OSError as err:
        raise SecretError(f"cannot read the job secret {path}: {err.strerror or err}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecretError(f"the job secret {path} is readable by others (mode {stat.S_IMODE(mode):o}); "
                          f"chmod 600 {path}")
    if len(text) < MIN_SECRET_CHARS or any(c.isspace() for c in text) or text.startswith("-"):
        raise SecretError(f"the job secret {path} must be one word of at least {MIN_SECRET_CHARS} characters, "
                          f"not starting with '-' (SGLang would read it as a flag) "
                          f"(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')")
    return text


def job_secret(run_dir: Path, secret_file: str = "") -> str:
    """The job's secret: the user's ``secret_file`` when given, else ``<run_dir>/secret``, made at the
    first start (``--resume`` and ``--join`` find it there; deleting it before a resume rotates it)."""
    if secret_file:
        return read_secret(Path(secret_file).expanduser())
    path = Path(run_dir) / SECRET_FILE
    if not path.exists():
        try:
            write_secret(path, new_secret())
        except FileExistsError:  # another process of the job made it first: use theirs
            pass
    return read_secret(path)


def job_env(secret: str, run_dir: Path) -> dict[str, str]:
    """The environment a job's launcher hands to every process it starts: the secret, the
    snapshots directory its engines may load from (the trainer writes ``<run_dir>/weights/v*``),
    the SGLang keys file (:func:`sglang_config_args`) and vLLM's key."""
    run_dir = Path(run_dir).resolve()
    return {SECRET_ENV: secret, WEIGHTS_ROOT_ENV: str(run_dir / "weights"),
            SGLANG_KEYS_ENV: str(run_dir / SGLANG_KEYS_FILE), VLLM_KEY_ENV: secret}


def write_sglang_keys(path: Path, secret: str) -> None:
    """SGLang's ``--config`` YAML setting ``api_key`` and ``admin_api_key`` to the job's secret (0600)."""
    if path.exists() and path.read_text() == _sglang_yaml(secret):
        return
    path.unlink(missing_ok=True)  # a rotated secret: write it anew
    try:
        write_secret(path, _sglang_yaml(secret).rstrip("\n"))
    except FileExistsError:  # another node of the job wrote the same text
        pass


def _sglang_yaml(secret: str) -> str:
    # keys as flag names: 0.5.23's config parser turns each into ``--<key>`` verbatim
    # (``utils/server_args_config_parser.py``), so ``api_key`` would be an unknown argument
    return f"api-key: {secret}\nadmin-api-key: {secret}\n"


def sglang_config_args(env: Mapping[str, str] | None = None) -> list[str]:
    """``--config <keys file>`` for an SGLang server started inside a job (none outside one).

    WHY a file: SGLang 0.5.23 reads no environment variable for its keys, but ``--config`` merges a
    YAML of its flags before parsing, so the keys never appear in ``ps``."""
    path = (os.environ if env is None else env).get(SGLANG_KEYS_ENV)
    return ["--config", path] if path else []


@contextmanager
def job_environment(run_dir: Path, secret_file: str = "") -> Iterator[str]:
    """While a job runs, its launcher's environment holds :func:`job_env`: every process it starts
    inherits it (never on a command line) and its in-process controller's clients send the secret.
    Restored afterwards, so a later job in the same process never sees this one's secret.

    The run directory is made private (0700) first: its snapshots are the policy's weights, and
    SGLang writes its keys into its own log there."""
    Path(run_dir).chmod(0o700)
    added = job_env(job_secret(run_dir, secret_file), run_dir)
    write_sglang_keys(Path(added[SGLANG_KEYS_ENV]), added[SECRET_ENV])
    before = {k: os.environ.get(k) for k in added}
    os.environ.update(added)
    try:
        yield added[SECRET_ENV]
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def secret_from_env(env: Mapping[str, str] | None = None) -> str | None:
    """The job's secret this process was given (None: started outside a job, nothing to send)."""
    value = (os.environ if env is None else env).get(SECRET_ENV, "")
    return value or None


def auth_headers(secret: str | None) -> dict[str, str]:
    """The header a client sends (none without a secret)."""
    return {"Authorization": f"Bearer {secret}"} if secret else {}


def check(authorization: str | None, key: str) -> int | None:
    """``None`` when ``authorization`` is ``Bearer <key>``; 401 without a bearer credential, 403 with a
    wrong one. Constant time in the offered value (:func:`hmac.compare_digest` on bytes)."""
    if not authorization:
        return 401
    scheme, _, offered = authorization.partition(" ")
    if scheme.lower() != "bearer" or not offered:
        return 401
    return None if hmac.compare_digest(offered.strip().encode(), key.encode()) else 403


@dataclass(frozen=True)
class Keys:
    """A server's keys (SGLang's ``--api-key`` / ``--admin-api-key``); both None: no check."""

    api_key: str | None = None
    admin_api_key: str | None = None

    @classmethod
    def of_job(cls, api_key: str | None = None, admin_api_key: str | None = None,
               env: Mapping[str, str] | None = None) -> "Keys":
        """Keys given explicitly, else the job's secret from the environment for both levels."""
        job = secret_from_env(env)
        if api_key is None and admin_api_key is None:
            return cls(job, job)
        return cls(api_key, admin_api_key)

    @property
    def enabled(self) -> bool:
        return bool(self.api_key or self.admin_api_key)

    def decide(self, path: str, admin: bool, authorization: str | None) -> int | None:
        """``None`` to serve the request, else the status to refuse it with (401 or 403)."""
        if path in OPEN_PATHS:
            return None
        key = (self.admin_api_key or self.api_key) if admin else self.api_key
        return None if not key else check(authorization, key)


DENIED = {401: "unauthorized: this job's endpoints need 'Authorization: Bearer <job secret>'",
          403: "forbidden: the credential offered is not this job's"}


def aiohttp_middleware(keys: Keys, admin_paths: Iterable[str]) -> Middleware:
    """An aiohttp middleware refusing a request before its handler runs (nothing is read of its
    body, nothing of the offered credential is logged). ``admin_paths``: the admin routes."""
    from aiohttp import web

    admin = frozenset(admin_paths)

    @web.middleware
    async def require_job_secret(request: web.Request, handler: Handler) -> StreamResponse:
        status = keys.decide(request.path, request.path in admin, request.headers.get("Authorization"))
        if status is not None:
            msg = DENIED[status]
            return web.json_response({"error": msg, "success": False, "message": msg}, status=status)
        return await handler(request)

    return require_job_secret


# ---- paths from requests stay inside the job -----------------------------------------------------
class OutsideJob(ValueError):
    """A path from a request that leaves the job's directories (answered 403, naming the rule)."""


def inside(path: str | Path, roots: Iterable[str | Path], rule: str) -> Path:
    """``path`` resolved (symlinks and ``..`` followed) when it lies under one of ``roots``; else
    :class:`OutsideJob` naming ``rule``."""
    resolved = Path(path).expanduser().resolve()
    for root in roots:
        r = Path(root).expanduser().resolve()
        if resolved == r or r in resolved.parents:
            return resolved
    raise OutsideJob(f"{path!r} is refused: {rule}")
