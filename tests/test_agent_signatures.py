"""The log signature scanner recognises each fault class from a realistic line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from aegis.agent import ports, signatures

FC = ports.FaultClass

# Each sample copies the format of a line users posted from real runs; the source is cited.
SAMPLES = [
    pytest.param(
        # https://github.com/hiyouga/LlamaFactory/issues/7396 (torch ProcessGroupNCCL watchdog)
        "[rank0]:[E321 02:07:08.408271257 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught "
        "collective operation timeout: WorkNCCL(SeqNum=1580, OpType=ALLREDUCE, NumelIn=466119168, "
        "NumelOut=466119168, Timeout(ms)=600000) ran for 600060 milliseconds before timing out.",
        FC.NCCL_TIMEOUT,
        id="nccl-watchdog",
    ),
    pytest.param(
        # https://github.com/pytorch/pytorch/issues/118369 (title line)
        "NCCL watchdog thread terminated with exception: [Rank 7] Watchdog caught collective "
        "operation timeout: WorkNCCL(SeqNum=96120, OpType=ALLREDUCE, Timeout(ms)=1800000) ran for "
        "25624887 milliseconds before timing out.",
        FC.NCCL_TIMEOUT,
        id="nccl-watchdog-terminated",
    ),
    pytest.param(
        # https://github.com/NVIDIA/nccl/issues/1381 (title line)
        "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/"
        "ProcessGroupNCCL.cpp:1691, unhandled system error (run with NCCL_DEBUG=INFO for details), "
        "NCCL version 2.19.3",
        FC.NCCL_ERROR,
        id="nccl-error",
    ),
    pytest.param(
        # https://github.com/3dlg-hcvc/multi3drefer/issues/14
        "RuntimeError: CUDA error: an illegal memory access was encountered",
        FC.CUDA_ERROR,
        id="cuda-error",
    ),
    pytest.param(
        # https://github.com/NVIDIA/NVSentinel/issues/155 (dmesg line of an Xid 79)
        "NVRM: Xid (PCI:0000:44:00): 79, GPU has fallen off the bus.",
        FC.GPU_XID,
        id="xid-79",
    ),
    pytest.param(
        # https://github.com/vllm-project/vllm/issues/5222
        "RuntimeError: CUDA error: uncorrectable ECC error encountered",
        FC.GPU_ECC,
        id="ecc",
    ),
    pytest.param(
        # https://github.com/pytorch/pytorch/issues/16417 (comment of 2024-03-13, torch >= 2.1 text)
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 22.00 MiB. GPU 0 has "
        "a total capacity of 23.65 GiB of which 11.06 MiB is free. Including non-PyTorch memory, "
        "this process has 23.60 GiB memory in use.",
        FC.CUDA_OOM,
        id="cuda-oom",
    ),
    pytest.param(
        # https://github.com/OPIXray-author/OPIXray/issues/5 (older torch text)
        "RuntimeError: CUDA out of memory. Tried to allocate 264.00 MiB (GPU 0; 2.00 GiB total "
        "capacity; 788.51 MiB already allocated; 145.93 MiB free; 1.02 GiB reserved in total by "
        "PyTorch)",
        FC.CUDA_OOM,
        id="cuda-oom-old",
    ),
    pytest.param(
        # the Linux OOM killer's kernel log line (mm/oom_kill.c: "Out of memory: Killed process")
        "[12345.678901] Out of memory: Killed process 4242 (python) total-vm:81234567kB, "
        "anon-rss:61234567kB, file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:123456kB oom_score_adj:0",
        FC.HOST_OOM,
        id="host-oom-kernel",
    ),
    pytest.param("MemoryError", FC.HOST_OOM, id="host-oom-python"),
    pytest.param(
        # https://github.com/lsongx/DomainAdaptiveReID/issues/3 (title line)
        "ConnectionResetError: [Errno 104] Connection reset by peer",
        FC.CONNECTION,
        id="connection-reset",
    ),
    pytest.param(
        # https://github.com/TheTom/vllm-swift/issues/9 (torch c10d TCPStore client)
        "[W426 16:56:01.831041000 TCPStore.cpp:347] [c10d] TCP client failed to connect/validate "
        "to host 100.64.0.1:59782 - retrying (try=6, timeout=1800000ms, delay=5241ms): "
        "Connection reset by peer",
        FC.CONNECTION,
        id="tcpstore-reset",
    ),
    pytest.param(
        "ConnectionRefusedError: [Errno 111] Connection refused", FC.CONNECTION, id="refused"
    ),
    pytest.param(
        # CPython faulthandler's header (Python/faulthandler.c)
        "Fatal Python error: Segmentation fault",
        FC.SEGFAULT,
        id="segfault-faulthandler",
    ),
    pytest.param(
        # bash's report of a child killed by SIGSEGV
        "bash: line 1:  4242 Segmentation fault      (core dumped) python train.py",
        FC.SEGFAULT,
        id="segfault-bash",
    ),
    pytest.param(
        # a checkpoint write on a failing disk (CPython's OSError text for EIO)
        "OSError: [Errno 5] Input/output error: '/ckpt/step-400/model.pt'",
        FC.IO_ERROR,
        id="io-eio",
    ),
    pytest.param(
        "RuntimeError: [enforce fail at inline_container.cc:595] . PytorchStreamWriter failed "
        "writing file data/0: file write failed: No space left on device",
        FC.IO_ERROR,
        id="io-enospc",
    ),
    pytest.param(
        # a gloo collective whose peer vanished (gloo's unbound_buffer.cc timeout)
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out "
        "waiting 1800000ms for recv operation to complete",
        FC.CONNECTION,
        id="gloo-timeout",
    ),
    pytest.param(
        # the rendezvous store's host is gone (torch.distributed's DistStoreError)
        "torch.distributed.DistStoreError: Socket Timeout",
        FC.CONNECTION,
        id="store-timeout",
    ),
    pytest.param(
        # torchrun's summary of a worker the OOM killer took
        "  exitcode  : -9 (pid: 4242)",
        FC.KILLED,
        id="torchrun-killed",
    ),
]


@pytest.mark.parametrize(("line", "fault_class"), SAMPLES)
def test_scanner_classifies_sample_when_line_is_realistic(line: str, fault_class: str) -> None:
    scanner = signatures.Scanner()
    matches = scanner.feed("stderr", line)
    assert [m.fault_class for m in matches] == [fault_class]
    assert scanner.evidence().fault_class == fault_class


def test_scanner_ignores_ordinary_lines_when_training_is_healthy() -> None:
    scanner = signatures.Scanner()
    for line in (
        "{'loss': 3.5534, 'grad_norm': 1.41, 'learning_rate': 2.05e-06, 'epoch': 0.01}",
        "NCCL INFO NCCL_IB_TIMEOUT set by environment to 22.",
        "  1%|          | 10/1752 [00:29<1:22:01,  2.83s/it]",
    ):
        assert scanner.feed("stdout", line) == ()
    assert scanner.evidence().fault_class is None


# A traceback as CPython 3.11 prints it (source and caret lines included).
TRACEBACK = """\
Traceback (most recent call last):
  File "/work/train.py", line 88, in <module>
    main()
  File "/work/train.py", line 61, in train_step
    loss = model(batch).sum()
           ^^^^^^^^^^^^
ValueError: batch is empty""".splitlines()


def test_scanner_reports_last_frame_when_traceback_ends() -> None:
    scanner = signatures.Scanner()
    found = [m for line in TRACEBACK for m in scanner.feed("stderr", line)]
    assert len(found) == 1
    assert found[0].fault_class == FC.PYTHON_TRACEBACK
    assert found[0].line == "ValueError: batch is empty"
    assert found[0].detail == 'File "/work/train.py", line 61, in train_step'


def test_scanner_follows_a_traceback_torch_distributed_prefixed_with_the_rank() -> None:
    scanner = signatures.Scanner()
    found = [m for line in TRACEBACK for m in scanner.feed("stderr", f"[rank3]: {line}")]
    assert [(m.fault_class, m.line, m.detail) for m in found] == [
        (FC.PYTHON_TRACEBACK, "ValueError: batch is empty",
         'File "/work/train.py", line 61, in train_step'),
    ]  # fmt: skip


def test_scanner_ranks_hardware_first_when_an_oom_ends_a_traceback() -> None:
    scanner = signatures.Scanner(keep_lines=3)
    lines = [*TRACEBACK[:-1], "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB"]
    for line in lines:
        scanner.feed("stderr", line)
    evidence = scanner.evidence()
    assert {m.fault_class for m in evidence.matches} == {FC.CUDA_OOM, FC.PYTHON_TRACEBACK}
    assert evidence.fault_class == FC.CUDA_OOM
    assert evidence.last_lines == tuple(lines[-3:])


def test_load_adds_signatures_first_when_file_extends_table(tmp_path: Path) -> None:
    path = tmp_path / "signatures.toml"
    path.write_text(
        '[[signature]]\nname = "lustre"\nfault_class = "io_error"\npattern = "LustreError: .*"\n'
    )
    table = signatures.load(path)
    assert table[0].name == "lustre" and table[1:] == signatures.DEFAULT_SIGNATURES
    scanner = signatures.Scanner(table)
    assert [m.fault_class for m in scanner.feed("stderr", "LustreError: 11-0: rc = -5")] == [
        "io_error"
    ]


@pytest.mark.parametrize(
    "text",
    [
        '[[signature]]\nname = "x"\nfault_class = "y"\npattern = "("\n',
        '[[signature]]\nname = "x"\n',
        '[[signature]]\nname = "x"\nfault_class = "y"\npattern = "z"\ncolour = "red"\n',
    ],
)
def test_load_raises_clear_error_when_file_is_bad(tmp_path: Path, text: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(signatures.SignatureConfigError):
        signatures.load(path)


@pytest.mark.parametrize("signature", signatures.DEFAULT_SIGNATURES, ids=lambda s: s.name)
def test_no_default_pattern_has_an_unbounded_gap(signature: signatures.Signature) -> None:
    """``a.*b`` tries every ``a`` to the end of the line: quadratic in the line's length (a
    64 KiB line of "Xid " blocked the agent's event loop for seconds); a bounded gap is linear."""
    for gap in (".*", ".+"):
        assert gap not in signature.pattern.pattern


def test_scanner_searches_only_a_lines_head_when_the_line_is_long() -> None:
    """What a pattern searches is at most SCAN_CHARS long, whatever a signature file adds (a
    pattern that needs one character more never matches); the whole line is still kept."""
    more = signatures.SCAN_CHARS + 1
    longer = signatures.Signature("longer", FC.IO_ERROR, re.compile(rf"\A[\s\S]{{{more}}}"))
    line = "Xid " * (65536 // 4)  # the adversarial piece: 64 KiB
    scanner = signatures.Scanner((longer, *signatures.DEFAULT_SIGNATURES))
    assert scanner.feed("stderr", line) == ()
    assert scanner.evidence().last_lines == (line,)
    head = "NVRM: Xid (PCI:0000:44:00): 79, GPU has fallen off the bus. " + line
    assert [m.signature for m in scanner.feed("stderr", head)] == ["nvrm_xid"]


# What one pod's output looks like when rank 1 of `torchrun --nproc-per-node 2` raises: its
# traceback, rank 0's broken gloo connection, torchrun's own traceback and failure report (an
# H200 run of benchmarks/gpu/cuda_train.py, 2026-12-04; frames shortened).
TORCHRUN_POD = [
    "[rank1]: Traceback (most recent call last):",
    '[rank1]:   File "/work/cuda_train.py", line 183, in main',
    '[rank1]:     raise RuntimeError(f"injected crash at step {step}")',
    "[rank0]: Traceback (most recent call last):",
    "[rank1]: RuntimeError: injected crash at step 150",
    '[rank0]:   File "/work/cuda_train.py", line 165, in main',
    "[rank0]:     loss.backward()",
    "[rank0]: RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:547] Connection "
    "closed by peer [127.0.0.1]:61159",
    "W1204 15:54:31.747000 844 torch/distributed/elastic/multiprocessing/api.py:1012] Sending "
    "process 866 closing signal SIGTERM",
    "Traceback (most recent call last):",
    '  File "/opt/torch/.venv/lib/python3.12/site-packages/torch/distributed/run.py", line 994',
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
    "============================================================",
    "cuda_train.py FAILED",
    "------------------------------------------------------------",
    "Failures:",
    "[1]:",
    "  time      : 2026-12-04_15:54:31",
    "  host      : localhost",
    "  rank      : 0 (local_rank: 0)",
    "  exitcode  : -15 (pid: 866)",
    "  error_file: <N/A>",
    "  traceback : Signal 15 (SIGTERM) received by PID 866",
    "------------------------------------------------------------",
    "Root Cause (first observed failure):",
    "[0]:",
    "  time      : 2026-12-04_15:54:31",
    "  host      : localhost",
    "  rank      : 1 (local_rank: 1)",
    "  exitcode  : 1 (pid: 867)",
    "  error_file: <N/A>",
    "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html",
    "============================================================",
]


def _evidence(lines: list[str]) -> ports.Evidence:
    scanner = signatures.Scanner()
    for line in lines:
        scanner.feed("stderr", line)
    return scanner.evidence()


def test_one_ranks_exception_under_torchrun_is_not_a_connection_fault_by_its_peers() -> None:
    """Rank 1 raised: rank 0's broken connection and its SIGTERM from torchrun are what a rank
    shows when its peer dies, not evidence. Interleaved, each rank's traceback is its own."""
    evidence = _evidence(TORCHRUN_POD)
    assert evidence.fault_class == FC.PYTHON_TRACEBACK
    assert [(m.line, m.detail) for m in evidence.matches] == [
        ("RuntimeError: injected crash at step 150",
         'File "/work/cuda_train.py", line 183, in main'),
        ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
         'File "/opt/torch/.venv/lib/python3.12/site-packages/torch/distributed/run.py", line 994'),
    ]  # fmt: skip


def test_the_root_cause_ranks_own_fault_class_is_kept_under_torchrun() -> None:
    lines = [line.replace("RuntimeError: injected crash at step 150",
                          "RuntimeError: CUDA error: an illegal memory access was encountered")
             for line in TORCHRUN_POD]  # fmt: skip
    assert _evidence(lines).fault_class == FC.CUDA_ERROR


def test_what_a_peer_shows_beyond_a_dead_peer_still_counts_under_torchrun() -> None:
    """A peer's own hardware trouble is no consequence of the root cause: it stays evidence."""
    lines = [*TORCHRUN_POD[:8], "[rank0]: RuntimeError: CUDA error: uncorrectable ECC error "
             "encountered", *TORCHRUN_POD[8:]]  # fmt: skip
    assert _evidence(lines).fault_class == FC.GPU_ECC


@pytest.mark.parametrize(
    "lines",
    [
        pytest.param(TORCHRUN_POD[:12], id="no-report"),  # torchrun was killed before it
        pytest.param([line.removeprefix("[rank1]: ") for line in TORCHRUN_POD], id="unprefixed"),
    ],
)
def test_without_the_root_causes_own_lines_every_match_counts(lines: list[str]) -> None:
    assert _evidence(lines).fault_class == FC.CONNECTION


# A CI run on this 2-core machine under load (2026-12-05, ``tests/test_local_ranks_e2e.py``):
# rank 1 raised, but was slow to exit; rank 0 aborted on the broken connection first, and
# torchrun named rank 0 the root cause (frames shortened).
TORCHRUN_SLOW_EXIT = [
    "[rank1]: Traceback (most recent call last):",
    '[rank1]:   File "/tmp/ci41/examples/train_ddp.py", line 132, in main',
    '[rank1]:     raise RuntimeError(f"injected crash of rank {rank} at step {step}")',
    "[rank1]: RuntimeError: injected crash of rank 1 at step 12",
    "[rank1]: [aegis] exiting on an uncaught RuntimeError (pid 9201)",
    "[rank0]: Traceback (most recent call last):",
    '[rank0]:   File "/tmp/ci41/examples/train_ddp.py", line 141, in main',
    "[rank0]:     loss.backward()",
    "[rank0]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553]"
    " Connection closed by peer [127.0.0.1]:17554. This is typically caused by a remote worker"
    " crashing.",
    "[rank0]: [aegis] exiting on an uncaught RuntimeError (pid 9200)",
    "terminate called without an active exception",
    "W1205 11:06:00.908000 9197 torch/distributed/elastic/multiprocessing/api.py:1028] Sending "
    "process 9201 closing signal SIGTERM",
    "E1205 11:06:00.924000 9197 torch/distributed/elastic/multiprocessing/api.py:1002] failed "
    "(exitcode: -6) local_rank: 0 (pid: 9200) of binary: /tmp/ci41/.venv/bin/python3.11",
    "Traceback (most recent call last):",
    '  File "/tmp/ci41/.venv/lib/python3.11/site-packages/torch/distributed/run.py", line 1032',
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
    "======================================================",
    "Failures:",
    "[1]:",
    "  rank      : 1 (local_rank: 1)",
    "  exitcode  : -15 (pid: 9201)  (SIGTERM)",
    "  traceback : Signal 15 (SIGTERM) received by PID 9201",
    "------------------------------------------------------",
    "Root Cause (first observed failure):",
    "[0]:",
    "  rank      : 0 (local_rank: 0)",
    "  exitcode  : -6 (pid: 9200)  (SIGABRT)",
    "  traceback : Signal 6 (SIGABRT) received by PID 9200",
    "======================================================",
]


def test_the_first_rank_to_raise_a_plain_exception_is_the_root_cause_when_slow_to_exit() -> None:
    """torchrun named rank 0, which only aborted on the connection rank 1's exit broke: rank 1's
    exception, raised first, is the fault (it was ``connection``, and the checks ran first)."""
    evidence = _evidence(TORCHRUN_SLOW_EXIT)
    assert evidence.fault_class == FC.PYTHON_TRACEBACK
    assert [m.line for m in evidence.matches] == [
        "RuntimeError: injected crash of rank 1 at step 12"
    ]


def test_a_first_exception_that_is_a_peers_consequence_leaves_torchruns_root_cause() -> None:
    """The first rank to raise did so on a broken connection (its peer died without a
    traceback, by a signal): torchrun's root cause, the dead peer, decides as before."""
    lines = [line for line in TORCHRUN_SLOW_EXIT if not line.startswith("[rank1]:")]
    lines = [line.replace("-6 (pid: 9200)  (SIGABRT)", "-11 (pid: 9200)  (SIGSEGV)")
             .replace("Signal 6 (SIGABRT)", "Signal 11 (SIGSEGV)") for line in lines]  # fmt: skip
    assert _evidence(lines).fault_class != FC.PYTHON_TRACEBACK
    assert _evidence(TORCHRUN_POD).fault_class == FC.PYTHON_TRACEBACK  # named and first agree
