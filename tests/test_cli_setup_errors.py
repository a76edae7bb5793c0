"""What a user mistypes or lacks before anything runs: one readable line on stderr, the exit
status, and nothing started or half-written. Each of these was a traceback (or, for an injected
fault on a node the run does not have, a run that quietly left the fault out)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from aegis.cli import main as cli
from aegis.platforms import run_settings


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert captured.out == ""
    assert lines[0].startswith("aegis: error: ")
    return lines[0]


def test_a_fault_injected_on_a_node_the_run_lacks_is_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logs = tmp_path / "logs"
    argv = ["run", "--nodes", "2", "--spare-nodes", "1", "--log-dir", str(logs)]
    assert cli.main([*argv, "--inject-fault", "node-9:gpu", "--", "true"]) == 2
    line = one_error_line(capsys)
    assert "no node node-9 in this run (it has node-0..node-1, spare-0)" in line
    assert list(logs.iterdir()) == []  # no master, no pod, no event log
    # A spare is a node of the run: the flag parses (and fails later only on what follows).
    assert cli.main([*argv, "--inject-fault", "spare-0:gpu", "--view", "bogus", "--", "x"]) == 2
    assert "--view" in one_error_line(capsys)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["run", "--log-dir", "{nodir}/logs", "--", "true"], "cannot make directory {nodir}/logs"),
        (["run", "--log-dir", "{file}", "--", "true"], "{file} is not a directory"),
        (["run", "--status-file", "{tmp}", "--", "true"], "{tmp} is a directory"),
        (["run", "--status-file", "{nodir}/s/st.json", "--", "true"], "cannot make directory"),
        (["auth", "init", "--out", "{file}/auth"], "cannot make directory {file}/auth"),
        (
            ["agent", "--master", "127.0.0.1:9", "--job", "j", "--pod", "p", "--token-file",
             "{tmp}/absent", "--", "true"],
            "cannot read {tmp}/absent: No such file or directory",
        ),
        (
            ["master", "--insecure", "--nats", "nats://127.0.0.1:9", "--log-dir", "{file}"],
            "{file} is not a directory",
        ),
    ],
    ids=["run-log-dir", "run-log-dir-file", "status-file-dir", "status-file", "auth-out",
         "agent-token", "master-log-dir"],
)  # fmt: skip
def test_a_path_the_command_cannot_use_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    file = tmp_path / "a-file"
    file.write_text("x")
    nodir = file / "below"  # below a file: no directory can be made there
    fill = {"tmp": tmp_path, "file": file, "nodir": nodir}
    assert cli.main([a.format(**fill) for a in argv]) == 2
    assert says.format(**fill) in one_error_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # nothing written


def test_a_run_makes_its_log_and_status_directories_before_it_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logs, status = tmp_path / "a" / "logs", tmp_path / "b" / "status.json"
    argv = ["run", "--log-dir", str(logs), "--status-file", str(status), "--view", "bogus"]
    assert cli.main([*argv, "--", "true"]) == 2  # stopped by --view, after the paths
    assert "--view" in one_error_line(capsys)
    assert logs.is_dir() and status.parent.is_dir() and not status.exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["operator"],
        ["webhook", "--make-cert", "--cert-dir", "{tmp}/certs"],
        ["master", "--insecure", "--kubernetes", "--nats", "nats://127.0.0.1:9"],
    ],
    ids=["operator", "webhook", "master"],
)
def test_kubernetes_commands_without_credentials_say_so_in_one_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
) -> None:
    pytest.importorskip("kopf")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in a pod
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("clusters: [\n")  # malformed: its YAML parser raises
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    assert cli.main([a.format(tmp=tmp_path) for a in argv]) == 1
    line = one_error_line(capsys)
    assert line.startswith("aegis: error: no Kubernetes credentials: not in a pod")
    assert f"$KUBECONFIG={kubeconfig}" in line
    assert not (tmp_path / "certs").exists()  # the webhook made no certificate


@pytest.mark.parametrize(
    "command",
    [["no-such-program-3f9"], ["no-such-program-3f9 --lr 1"], ["./no-such-script.sh", "--lr", "1"]],
    ids=["word", "bash-string", "path"],
)
def test_a_command_that_is_not_on_this_machine_is_refused_before_the_run(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    command: list[str],
) -> None:
    """It was four faults, each "exit status 127" and a check round, then Failed with the
    fault budget spent."""
    monkeypatch.chdir(tmp_path)
    logs = tmp_path / "logs"
    assert cli.main(["run", "--nodes", "1", "--log-dir", str(logs), "--", *command]) == 2
    program = command[0].split()[0]
    assert f"aegis: error: {program}: command not found" in one_error_line(capsys)
    assert not logs.exists() or list(logs.iterdir()) == []


def test_the_program_a_command_starts_is_named_unless_the_shell_decides() -> None:
    bash = ("bash", "-c")
    cases = {
        ("python", "train.py"): "python",
        (*bash, "python train.py --lr 1"): "python",
        (*bash, "./run.sh"): "./run.sh",
        (*bash, "cd /data && python train.py"): "cd",  # a builtin: bash is asked about it
        (*bash, "FOO=1 python train.py"): None,  # an assignment first
        (*bash, "'unclosed"): None,
        (*bash, "$TRAIN"): None,
        (*bash, ""): None,
    }
    assert {c: run_settings.program_of(c) for c in cases} == cases


@pytest.mark.parametrize("as_string", [False, True], ids=["argv", "bash-string"])
def test_a_python_script_that_is_not_there_is_refused_before_the_run(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    as_string: bool,
) -> None:
    """``python trian.py`` exited 2 in every pod ("can't open file"), four faults and Failed."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    command = [sys.executable, "trian.py", "--lr", "1"]
    argv = ["run", "--nodes", "1", "--log-dir", str(tmp_path / "logs"), "--"]
    assert cli.main([*argv, *([" ".join(command)] if as_string else command)]) == 2
    assert "aegis: error: trian.py: no such file" in one_error_line(capsys)
    bash = ("bash", "-c")
    assert run_settings.script_of((sys.executable, "train.py"), os.environ) == "train.py"
    assert run_settings.script_of((*bash, "python -u train.py --x"), os.environ) == "train.py"
    assert run_settings.script_of((*bash, "cd /d && python t.py"), os.environ) is None
    assert run_settings.script_of((sys.executable, "-m", "pkg.train"), os.environ) is None
