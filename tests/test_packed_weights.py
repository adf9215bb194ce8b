"""Weights packed for an engine process: one flat buffer per dtype, unpacked bitwise equal, and
they cross a process boundary (torch.multiprocessing) without being copied through the pipe."""

import pytest
import torch
import torch.multiprocessing as mp

from megatron_rl.rollout.embedded.packed import PackedWeights, pack_weights


def _named():
    g = torch.Generator().manual_seed(0)
    return [("a.weight", torch.randn(3, 4, generator=g)), ("a.bias", torch.randn(4, generator=g)),
            ("b.weight", torch.randn(2, 3, generator=g).to(torch.bfloat16)),
            ("c.weight", torch.randn(5, 2, generator=g).t())]  # not contiguous


def test_pack_round_trip_is_bitwise_and_one_buffer_per_dtype():
    named = _named()
    packed = pack_weights(named)
    assert sorted(packed.buffers) == ["bfloat16", "float32"]
    assert packed.nbytes == sum(t.numel() * t.element_size() for _, t in named)
    out = dict(packed)
    assert list(out) == [name for name, _ in named]
    for name, t in named:
        assert out[name].shape == t.shape and out[name].dtype == t.dtype
        assert torch.equal(out[name], t)
    assert all(b.is_shared() for b in packed.buffers.values())  # allocated in shared memory


def _child(conn):
    packed: PackedWeights = conn.recv()
    conn.send({name: t.clone() for name, t in packed})
    conn.recv()  # stay alive until the parent has mapped the tensors sent back


def test_packed_weights_reach_another_process_intact():
    named = _named()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(child,))
    proc.start()
    parent.send(pack_weights(named))
    got = parent.recv()
    parent.send("done")
    proc.join(60)
    assert proc.exitcode == 0
    for name, t in named:
        assert torch.equal(got[name], t)


def _child_cuda(conn):
    packed: PackedWeights = conn.recv()
    # What the engine does with them: copy out of the mapped buffer into its own tensors.
    conn.send({name: t.to("cpu", copy=True) for name, t in packed})
    conn.recv()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU (CI has none; run on the GPU machine)")
@pytest.mark.parametrize("engine_gpu", [0, 1])
def test_packed_weights_reach_a_child_through_cuda_ipc(engine_gpu):
    """On a GPU the packed buffer is built on the engine's GPU and handed over as a CUDA IPC handle
    (no copy through host memory); the child reads the exact values."""
    if engine_gpu >= torch.cuda.device_count():
        pytest.skip(f"needs {engine_gpu + 1} GPUs")
    named = [(name, t.to("cuda:0")) for name, t in _named()]
    packed = pack_weights(named, torch.device("cuda", engine_gpu))
    assert all(b.device == torch.device("cuda", engine_gpu) for b in packed.buffers.values())
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child_cuda, args=(child,))
    proc.start()
    parent.send(packed)
    got = parent.recv()
    parent.send("done")
    proc.join(120)
    assert proc.exitcode == 0
    for name, t in named:
        assert torch.equal(got[name], t.cpu())
