"""What every benchmark shares: servers it starts and stops itself, wrk, tables, JSON.

Everything here talks to 127.0.0.1 only. A benchmark makes one scratch directory, starts its
servers (``ivy-sandbox serve`` or a baseline app) on free ports with their own data
directories, and stops them by PID at the end — after stopping every sandbox they made
through the API and killing whatever is left in those sandboxes' cgroups (sandboxes are
built to survive their control plane, so a killed server alone would leak them).

Not a library of the package: ``bench/`` scripts add this directory to ``sys.path`` (Python
does that for ``python bench/NAME.py``) and import ``_common``.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import datetime as dt
import hashlib
import json
import math
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
VENV_BIN = Path(sys.executable).parent
START_TIMEOUT = 30.0
HOST = "127.0.0.1"


class BenchError(RuntimeError):
    """A benchmark that cannot produce an honest number stops with this (exit code 1)."""


# -- command line ----------------------------------------------------------------------------
def parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"python bench/{name}.py",
        description=(doc or "").strip().split("\n\n")[0],
        epilog="Needs wrk (apt-get install -y wrk). Results: bench/results/.",
    )
    p.add_argument("--quick", action="store_true", help="a short run (well under a minute)")
    p.add_argument(
        "--json-out",
        type=Path,
        default=None,
        help=f"where to write the JSON (default: bench/results/{name}[-quick].json)",
    )
    p.add_argument("--keep", action="store_true", help="keep the scratch directory (logs)")
    return p


def json_path(name: str, args: argparse.Namespace) -> Path:
    if args.json_out is not None:
        return Path(args.json_out)
    return RESULTS_DIR / f"{name}{'-quick' if args.quick else ''}.json"


def main_guard(run: Any, name: str, doc: str | None, *, needs_wrk: bool = False) -> None:
    """Parse arguments, run ``run(args, scratch)``, always clean up; exit 1 on BenchError."""
    args = parser(name, doc).parse_args()
    if needs_wrk:
        require_wrk()  # before anything is started or created
    _install_signal_handlers()
    _NOISE["start"] = _cpu_snapshot()
    scratch = Path(tempfile.mkdtemp(prefix=f"ivy-bench-{name}-"))
    ok = False
    try:
        run(args, scratch)
        ok = True
    except BenchError as exc:
        print(f"\nBENCHMARK FAILED: {exc}", file=sys.stderr)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
    finally:
        cleanup_all()
        if args.keep or not ok:
            print(f"scratch directory (logs): {scratch}", file=sys.stderr)
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    if not ok:
        sys.exit(1)


def _install_signal_handlers() -> None:
    def interrupt(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


# -- tools -----------------------------------------------------------------------------------
def require_wrk() -> str:
    path = shutil.which("wrk")
    if path is None:
        print(
            "wrk is not installed. Install it with `apt-get install -y wrk` (Debian/Ubuntu; "
            "`brew install wrk` on macOS), then run this benchmark again.",
            file=sys.stderr,
        )
        sys.exit(2)
    return path


def taskset_prefix(cpu: str | None) -> list[str]:
    """``taskset -c CPU`` when taskset exists and the machine has that CPU, else nothing."""
    path = shutil.which("taskset")
    if cpu is None or path is None or (os.cpu_count() or 1) < 2:
        return []
    return [path, "-c", cpu]


def pin_self(cpu: int | None) -> None:
    """Pin this (client) process to one CPU, away from the pinned server."""
    if cpu is not None and (os.cpu_count() or 1) >= 2 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})


def repin(pid: int, cpus: str) -> None:
    """Move every thread of a running process to ``cpus`` (``taskset -a -p``)."""
    path = shutil.which("taskset")
    if path and (os.cpu_count() or 1) >= 2:
        subprocess.run(  # noqa: S603 - fixed argv
            [path, "-a", "-p", "-c", cpus, str(pid)], check=False, capture_output=True
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]
        return port


def ivy_cli() -> str:
    candidate = VENV_BIN / "ivy-sandbox"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("ivy-sandbox")
    if found is None:
        raise BenchError("ivy-sandbox is not installed (pip install -e . in the venv)")
    return found


# -- processes -------------------------------------------------------------------------------
_LIVE: list[Server] = []


@dataclass
class Server:
    """One HTTP server subprocess on 127.0.0.1, stopped by its PID."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_dir: Path
    ready_path: str = "/"
    port: int = 0
    process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def url(self, path: str) -> str:
        return self.base_url + path

    def logs(self, tail: int = 3000) -> str:
        out = []
        for suffix in ("out", "err"):
            path = self.log_dir / f"{self.name}.{suffix}"
            if path.exists():
                out.append(f"--- {path} ---\n{path.read_text(errors='replace')[-tail:]}")
        return "\n".join(out)

    def start(self) -> None:
        self.port = self.port or free_port()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        argv = [a.replace("{port}", str(self.port)) for a in self.argv]
        with (
            open(self.log_dir / f"{self.name}.out", "wb") as out,
            open(self.log_dir / f"{self.name}.err", "wb") as err,
        ):
            self.process = subprocess.Popen(  # noqa: S603 - argv built by the benchmark
                argv, env=self.env, stdin=subprocess.DEVNULL, stdout=out, stderr=err, cwd=REPO
            )
        _LIVE.append(self)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise BenchError(
                    f"{self.name} exited with {self.process.returncode}\n{self.logs()}"
                )
            try:
                httpx.get(self.url(self.ready_path), timeout=1)
                return
            except httpx.TransportError:
                time.sleep(0.1)
        raise BenchError(f"{self.name} did not answer within {START_TIMEOUT} s\n{self.logs()}")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)

    def cleanup(self) -> None:
        self.stop()


def cleanup_all() -> None:
    while _LIVE:
        server = _LIVE.pop()
        try:
            server.cleanup()
        except Exception as exc:  # cleanup must go on for the other servers
            print(f"cleanup of {server.name} failed: {exc!r}", file=sys.stderr)


atexit.register(cleanup_all)


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment without any IVY_ variable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("IVY_")}
    env.update(extra or {})
    return env


HIGH_LIMIT = "100000000/minute"  # never trips; the limiter still runs on every request


@dataclass
class IvyServer(Server):
    """``ivy-sandbox serve`` with its own data directory; knows how to clean its sandboxes."""

    data_dir: Path = Path()
    # chat → the headers that may stop its sandbox (DELETE at cleanup)
    chats_with_sandboxes: dict[str, dict[str, str]] = field(default_factory=dict)
    api_key: str = ""

    @classmethod
    def create(
        cls,
        scratch: Path,
        name: str = "ivy",
        env: Mapping[str, str] | None = None,
        cpu: str | None = None,
    ) -> IvyServer:
        data_dir = (scratch / name / "data").resolve()
        settings = {
            "IVY_DATA_DIR": str(data_dir),
            "IVY_RATE_LIMIT": HIGH_LIMIT,
            "IVY_RATE_LIMIT_PER_CHAT": HIGH_LIMIT,
            "IVY_AUTH_FAILURE_LIMIT": HIGH_LIMIT,
            "IVY_RATE_LIMIT_LAUNCH": HIGH_LIMIT,
        }
        settings.update(env or {})
        argv = [*taskset_prefix(cpu), ivy_cli(), "serve", "--host", HOST, "--port", "{port}"]
        return cls(
            name=name,
            argv=argv,
            env=clean_env(settings),
            log_dir=scratch / name,
            ready_path="/openapi.json",
            data_dir=data_dir,
        )

    def admin(self, *args: str) -> str:
        """``ivy-sandbox admin ARGS`` on this server's configuration; its one output line."""
        result = subprocess.run(  # noqa: S603 - fixed argv
            [ivy_cli(), "admin", *args],
            env=self.env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if result.returncode != 0:
            raise BenchError(f"admin {' '.join(args)} failed: {result.stderr.strip()}")
        return result.stdout.strip()

    def bulk_chats(self, user: str, count: int) -> list[str]:
        """``count`` chats for ``user``: the admin CLI's own use case, in one process
        (``admin chats create`` costs ~0.9 s of interpreter start-up per chat)."""
        code = (
            "import sys\n"
            "from ivy_sandbox.cli.common import run_with_repository, settings_or_exit\n"
            "from ivy_sandbox.services import accounts\n"
            "from ivy_sandbox.services.clock import SystemClock\n"
            "user, n = sys.argv[1], int(sys.argv[2])\n"
            "async def make(repository):\n"
            "    clock = SystemClock()\n"
            "    return [(await accounts.create_chat(repository, clock, user, None)).id\n"
            "            for _ in range(n)]\n"
            "print('\\n'.join(run_with_repository(settings_or_exit(), make)))\n"
        )
        result = subprocess.run(  # noqa: S603 - fixed argv
            [sys.executable, "-c", code, user, str(count)],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if result.returncode != 0:
            raise BenchError(f"creating {count} chats failed: {result.stderr.strip()[-2000:]}")
        chats = result.stdout.split()
        if len(chats) != count:
            raise BenchError(f"asked for {count} chats, got {len(chats)}")
        return chats

    def account(self, user: str) -> tuple[str, str]:
        """A user, one chat and an API key, through the admin CLI. Returns (chat, key)."""
        self.admin("users", "create", user)
        chat = self.admin("chats", "create", "--user", user)
        self.api_key = self.admin("keys", "create", "--user", user)
        return chat, self.api_key

    def auth(self, key: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {key or self.api_key}"}

    def rss_kb(self) -> int:
        return proc_status_kb(self.pid, "VmRSS")

    def threads(self) -> int:
        return proc_status_kb(self.pid, "Threads")

    def stop_sandboxes(self) -> None:
        """Stop every sandbox we launched through the API (DELETE), a few at a time."""
        chats = dict(self.chats_with_sandboxes)
        if not chats or self.process is None or self.process.poll() is not None:
            return

        async def stop_all() -> None:
            limits = httpx.Limits(max_connections=8)
            async with httpx.AsyncClient(limits=limits, timeout=60) as client:
                gate = asyncio.Semaphore(8)

                async def stop(chat: str) -> None:
                    async with gate:
                        with contextlib.suppress(httpx.HTTPError):
                            r = await client.delete(
                                self.url(f"/v1/sandbox/{chat}"), headers=chats[chat]
                            )
                            if r.status_code == 200:
                                self.chats_with_sandboxes.pop(chat, None)

                await asyncio.gather(*(stop(c) for c in chats))

        asyncio.run(stop_all())

    def cleanup(self) -> None:
        try:
            self.stop_sandboxes()
        finally:
            self.stop()
            killed, removed = kill_sandbox_cgroups(self.data_dir)
            if killed:
                print(
                    f"{self.name}: killed {len(killed)} leftover sandbox process(es) by cgroup; "
                    f"removed {removed} cgroup(s)",
                    file=sys.stderr,
                )
            release_workspace_images(self.data_dir)


def release_workspace_images(data_dir: Path) -> None:
    """Unmount the workspace images a server made (the service keeps them mounted)."""
    root = data_dir / "workspaces"
    if not root.is_dir():
        return
    mounted = [
        line.split()[1]
        for line in Path("/proc/self/mounts").read_text().splitlines()
        if line.split()[1].startswith(str(root) + "/")
    ]
    for target in mounted:
        subprocess.run(["umount", target], check=False, capture_output=True)  # noqa: S603, S607


def proc_status_kb(pid: int, field_name: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    raise BenchError(f"/proc/{pid}/status has no {field_name}")


# -- sandbox processes, found by cgroup ------------------------------------------------------
def sandbox_cgroup_prefix(data_dir: Path) -> str:
    """The local backend names a sandbox's cgroups ``ivy-<sha256(data dir)[:8]>-<sandbox>``."""
    digest = hashlib.sha256(str(Path(data_dir).resolve()).encode()).hexdigest()[:8]
    return f"ivy-{digest}-"


def sandbox_processes(data_dir: Path) -> dict[int, str]:
    """pid → cgroup name, for every process in one of this data dir's sandbox cgroups."""
    needle = "/" + sandbox_cgroup_prefix(data_dir)
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "cgroup").read_text()
        except OSError:
            continue
        at = text.find(needle)
        if at >= 0:
            found[int(entry.name)] = text[at + 1 :].split("\n", 1)[0].split("/", 1)[0]
    return found


def describe_processes(pids: Iterable[int]) -> list[dict[str, Any]]:
    """pid, state (R/S/Z…), ppid, uid and command of each process still there."""
    out = []
    for pid in sorted(pids):
        with contextlib.suppress(OSError, IndexError):
            stat = Path(f"/proc/{pid}/stat").read_text()
            comm = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2 :].split()
            status = Path(f"/proc/{pid}/status").read_text()
            uid = next(line.split()[1] for line in status.splitlines() if line.startswith("Uid:"))
            out.append(
                {
                    "pid": pid,
                    "state": fields[0],
                    "ppid": int(fields[1]),
                    "uid": int(uid),
                    "comm": comm,
                }
            )
    return out


def lingering_sandbox_processes(data_dir: Path, wait: float = 3.0) -> dict[str, Any]:
    """Sandbox processes right after every stop answered, and after ``wait`` seconds."""
    first = describe_processes(sandbox_processes(data_dir))
    deadline = time.monotonic() + wait
    later = first
    while later and time.monotonic() < deadline:
        time.sleep(0.1)
        later = describe_processes(sandbox_processes(data_dir))
    return {
        "right_after_stop": len(first),
        "right_after_stop_states": sorted({p["state"] for p in first}),
        f"after_{wait:g}_s": len(later),
        "still_there": later[:20],
    }


def _cgroup_bases() -> list[Path]:
    """This process's own cgroup directory in every mounted hierarchy (v1 and v2)."""
    own: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        number, controllers, path = line.split(":", 2)
        own[controllers if number != "0" else ""] = path
    bases = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fstype, _source, options = [*right.split(), "", "", ""][:3]
        if fstype not in ("cgroup", "cgroup2"):
            continue
        fields = left.split()
        root, mountpoint = fields[3], fields[4]
        if fstype == "cgroup2":
            path = own.get("")
        else:
            opts = set(options.split(","))
            path = next(
                (p for c, p in own.items() if c and set(c.split(",")) <= opts),
                None,
            )
        if path is None:
            continue
        relative = os.path.relpath(path, root) if path.startswith(root) else path.lstrip("/")
        bases.append(Path(mountpoint) / relative)
    return bases


def sandbox_cgroup_dirs(data_dir: Path) -> list[Path]:
    prefix = sandbox_cgroup_prefix(data_dir)
    dirs: list[Path] = []
    for base in _cgroup_bases():
        with contextlib.suppress(OSError):
            dirs += [p for p in base.iterdir() if p.name.startswith(prefix) and p.is_dir()]
    return dirs


def kill_sandbox_cgroups(data_dir: Path) -> tuple[list[int], int]:
    """SIGKILL every process in this data dir's sandbox cgroups, then remove the cgroups."""
    killed: list[int] = []
    for _ in range(50):
        pids = [
            p["pid"] for p in describe_processes(sandbox_processes(data_dir)) if p["state"] != "Z"
        ]
        if not pids:
            break  # zombies are their parent's to reap
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        time.sleep(0.1)
    removed = 0
    for directory in sandbox_cgroup_dirs(data_dir):
        for sub in sorted(directory.rglob("*"), key=lambda p: -len(p.parts)):
            if sub.is_dir():
                with contextlib.suppress(OSError):
                    sub.rmdir()
        with contextlib.suppress(OSError):
            directory.rmdir()
            removed += 1
    return sorted(set(killed)), removed


def smaps_rollup_kb(pid: int) -> dict[str, int]:
    """Rss and Pss (kB) of one process from /proc/PID/smaps_rollup; {} if it is gone."""
    values: dict[str, int] = {}
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return values
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name in ("Rss", "Pss", "Private_Clean", "Private_Dirty", "Swap"):
            values[name] = int(rest.split()[0])
    return values


def meminfo_kb(name: str = "MemAvailable") -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1])
    raise BenchError(f"/proc/meminfo has no {name}")


# -- session tokens --------------------------------------------------------------------------
@dataclass
class SessionKeys:
    """An RSA key pair; tokens minted like tests/conftest.py's TokenFactory does."""

    private_key: Any
    public_pem: str

    @classmethod
    def generate(cls) -> SessionKeys:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa

        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        pem = key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        return cls(key, pem.decode())

    def token(self, user_id: str, lifetime: int = 3600) -> str:
        import jwt

        now = int(time.time())
        claims = {
            "sub": user_id,
            "sid": "sess_bench",
            "iat": now - 1,
            "nbf": now - 1,
            "exp": now + lifetime,
        }
        return jwt.encode(
            claims, self.private_key, algorithm="RS256", headers={"kid": "bench", "typ": "JWT"}
        )


# -- wrk -------------------------------------------------------------------------------------
DONE_LUA = r"""
-- Prints one machine-readable line at the end: counts, errors and latency percentiles (us).
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {"requests":%.0f,"duration_us":%.0f,"bytes":%.0f,' ..
    '"connect":%.0f,"read":%.0f,"write":%.0f,"status":%.0f,"timeout":%.0f,' ..
    '"p50_us":%.1f,"p90_us":%.1f,"p99_us":%.1f,"p999_us":%.1f,"max_us":%.1f,"mean_us":%.1f}\n',
    summary.requests, summary.duration, summary.bytes,
    e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency:percentile(99.9), latency.max, latency.mean))
end
"""


@dataclass
class WrkResult:
    label: str
    connections: int
    duration_s: float
    requests: int
    rps: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    p999_ms: float
    max_ms: float
    mean_ms: float
    errors: dict[str, int]
    non_2xx: int

    def row(self) -> list[Any]:
        return [self.label, self.connections, round(self.rps), self.p50_ms, self.p99_ms]


def wrk(
    url: str,
    *,
    label: str,
    connections: int,
    duration: float,
    headers: Mapping[str, str] | None = None,
    threads: int = 1,
    cpu: str | None = "1",
    scratch: Path,
    allow_errors: bool = False,
) -> WrkResult:
    """Run wrk; fail loudly on any non-2xx response or socket error (a benchmark of 401s
    or 429s measures nothing)."""
    binary = require_wrk()
    script = scratch / "wrk-done.lua"
    if not script.exists():
        script.write_text(DONE_LUA)
    argv = [
        *taskset_prefix(cpu),
        binary,
        f"-t{threads}",
        f"-c{connections}",
        f"-d{max(1, round(duration))}s",
        "--timeout",
        "10s",
        "-s",
        str(script),
    ]
    for name, value in (headers or {}).items():
        argv += ["-H", f"{name}: {value}"]
    argv.append(url)
    result = subprocess.run(  # noqa: S603 - argv built here
        argv, capture_output=True, text=True, timeout=duration + 60, check=False
    )
    out = result.stdout
    match = re.search(r"^WRKJSON (\{.*\})$", out, re.MULTILINE)
    if result.returncode != 0 or match is None:
        raise BenchError(f"wrk failed ({result.returncode}): {out}\n{result.stderr}")
    data = json.loads(match.group(1))
    non_2xx_match = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    non_2xx = int(non_2xx_match.group(1)) if non_2xx_match else 0
    errors = {k: int(data[k]) for k in ("connect", "read", "write", "status", "timeout")}
    if not allow_errors and (non_2xx or any(errors.values())):
        raise BenchError(
            f"{label}: wrk saw non-2xx responses or socket errors ({non_2xx} non-2xx, "
            f"errors {errors}); the numbers would be meaningless.\n{out}"
        )
    seconds = data["duration_us"] / 1e6
    return WrkResult(
        label=label,
        connections=connections,
        duration_s=round(seconds, 2),
        requests=int(data["requests"]),
        rps=round(data["requests"] / seconds, 1),
        p50_ms=round(data["p50_us"] / 1000, 3),
        p90_ms=round(data["p90_us"] / 1000, 3),
        p99_ms=round(data["p99_us"] / 1000, 3),
        p999_ms=round(data["p999_us"] / 1000, 3),
        max_ms=round(data["max_us"] / 1000, 3),
        mean_ms=round(data["mean_us"] / 1000, 3),
        errors=errors,
        non_2xx=non_2xx,
    )


def check_200(url: str, headers: Mapping[str, str] | None = None) -> dict[str, Any]:
    """One request before a load run: it must be a 200 with a JSON body."""
    response = httpx.get(url, headers=dict(headers or {}), timeout=10)
    if response.status_code != 200:
        raise BenchError(f"GET {url} answered {response.status_code}: {response.text[:500]}")
    body: dict[str, Any] = response.json()
    return body


# -- statistics, tables, JSON ----------------------------------------------------------------
def percentile(values: Sequence[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); nan when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summary_ms(values_ms: Sequence[float]) -> dict[str, float | int]:
    if not values_ms:
        return {"n": 0}
    return {
        "n": len(values_ms),
        "p50_ms": round(percentile(values_ms, 50), 2),
        "p90_ms": round(percentile(values_ms, 90), 2),
        "p99_ms": round(percentile(values_ms, 99), 2),
        "max_ms": round(max(values_ms), 2),
        "mean_ms": round(statistics.fmean(values_ms), 2),
        "min_ms": round(min(values_ms), 2),
    }


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def fmt(value: Any) -> str:
        if isinstance(value, float):
            if math.isnan(value):
                return "-"
            return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
        return "-" if value is None else str(value)

    cells = [[fmt(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    for row in cells:
        lines.append("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
    text = "\n".join(lines)
    print("\n" + text, flush=True)
    return text


def machine() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    versions = {}
    for package in ("uvicorn", "fastapi", "starlette", "sqlalchemy", "aiosqlite", "pyjwt"):
        with contextlib.suppress(Exception):
            from importlib.metadata import version

            versions[package] = version(package)
    wrk_path = shutil.which("wrk")
    wrk_version = ""
    if wrk_path:
        probe = subprocess.run(  # noqa: S603 - fixed argv
            [wrk_path, "--version"], capture_output=True, text=True, check=False
        )
        wrk_version = (probe.stdout + probe.stderr).split("\n", 1)[0].strip()
    commit = ""
    with contextlib.suppress(OSError):
        head = (REPO / ".git" / "HEAD").read_text().strip()
        if head.startswith("ref: "):
            ref = REPO / ".git" / head[5:]
            commit = ref.read_text().strip() if ref.exists() else head[5:]
        else:
            commit = head
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "mem_total_mb": round(meminfo_kb("MemTotal") / 1024),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "versions": versions,
        "wrk": wrk_version,
        "git_head": commit,
    }


_NOISE: dict[str, tuple[float, float, float, float]] = {}


def host_cpu_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, all cores together."""
    tick = os.sysconf("SC_CLK_TCK")
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    total = sum(fields[:8])
    return (total - idle) / tick, total / tick


def own_cpu_s() -> float:
    """CPU seconds this process (the benchmark client) has used."""
    times = os.times()
    return times.user + times.system


def _cpu_snapshot() -> tuple[float, float, float, float]:
    """(wall, host busy CPU s, host total CPU s, CPU s used by us and our descendants)."""
    tick = os.sysconf("SC_CLK_TCK")
    busy, total = host_cpu_s()
    times = os.times()
    ours = times.user + times.system + times.children_user + times.children_system
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[1]) == me:  # a live child: its CPU and its reaped children's
                ours += sum(int(x) for x in stat[11:15]) / tick
    return time.time(), busy, total, ours


def noise() -> dict[str, Any]:
    """How much CPU the rest of the machine used while we ran (other sessions, tests)."""
    start = _NOISE.get("start")
    if start is None:
        return {}
    end = _cpu_snapshot()
    wall = end[0] - start[0]
    busy = end[1] - start[1]
    ours = end[3] - start[3]
    other = max(0.0, busy - ours)
    return {
        "wall_s": round(wall, 1),
        "host_busy_cpu_s": round(busy, 1),
        "benchmark_cpu_s": round(ours, 1),
        "other_cpu_s": round(other, 1),
        "other_cpu_share_of_machine": round(other / max(1e-9, end[2] - start[2]), 3),
        "loadavg_at_end": os.getloadavg(),
    }


def write_json(path: Path, name: str, args: argparse.Namespace, results: dict[str, Any]) -> None:
    payload = dict(results)
    payload["meta"] = {
        "benchmark": name,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "quick": bool(args.quick),
        "machine": machine(),
        "noise": noise(),
    }
    print(f"\nother load on the machine during the run: {payload['meta']['noise']}")
    path.parent.mkdir(parents=True, exist_ok=True)
    plain = json.loads(json.dumps(payload, default=_jsonable))
    path.write_text(_compact(plain) + "\n")
    print(f"\nJSON written to {path}")


def _compact(value: Any, indent: int = 0) -> str:
    """JSON with objects indented, lists of scalars and records on one line each."""
    pad = "  " * (indent + 1)
    if isinstance(value, dict) and value:
        items = [f"{pad}{json.dumps(k)}: {_compact(v, indent + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + "  " * indent + "}"
    if isinstance(value, list) and any(isinstance(v, dict | list) for v in value):
        # records (e.g. one per launch or per wrk run): one line each
        items = [
            pad + json.dumps(v) if isinstance(v, dict) else pad + _compact(v, indent + 1)
            for v in value
        ]
        return "[\n" + ",\n".join(items) + "\n" + "  " * indent + "]"
    return json.dumps(value)


def _jsonable(value: Any) -> Any:
    if isinstance(value, WrkResult):
        return asdict(value)
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and math.isnan(value):
        return None
    raise TypeError(f"not JSON: {type(value)}")


def rfc3339_to_epoch(text: str) -> float:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else math.nan


# -- an SSE reader with receive timestamps ---------------------------------------------------
async def sse_events(
    client: httpx.AsyncClient, url: str, headers: Mapping[str, str], *, read_timeout: float = 60
) -> Any:
    """Yield (wall-clock receive time, event name, parsed data) for every SSE event.

    Raises BenchError for a non-200 answer. The time is taken when the blank line ending the
    event is read, before the JSON is parsed.
    """
    async with client.stream("GET", url, headers=dict(headers), timeout=read_timeout) as response:
        if response.status_code != 200:
            body = (await response.aread()).decode(errors="replace")
            raise BenchError(f"GET {url} answered {response.status_code}: {body[:300]}")
        event, data = "message", []
        async for line in response.aiter_lines():
            if line == "":
                if data:
                    received = time.time()
                    yield received, event, json.loads("\n".join(data))
                event, data = "message", []
            elif line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())


def all_cpus() -> str:
    return f"0-{(os.cpu_count() or 1) - 1}"
