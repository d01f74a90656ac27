"""``device.PinnedStaging``: host arrays of several dtypes and shapes -> device tensors in one
copy (each at an aligned offset of one buffer), and the sampling tensors that go through it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rackserve.device import PinnedStaging
from rackserve.request import SamplingParams
from rackserve.runner.inputs import BlockTables
from rackserve.runner.sampling_tensors import SamplingTensors
from rackserve.runner.step_buffers import StaticInputs, StepBuffers


def _arrays(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [
        rng.standard_normal(5).astype(np.float32),  # 20 bytes: the next one is realigned
        rng.random(3) < 0.5,  # bool, 3 bytes
        rng.integers(-(2**62), 2**62, size=7),  # int64
        rng.integers(0, 100, size=(3, 4)),  # 2-D int64
        np.zeros(0, dtype=np.float32),  # empty
        rng.standard_normal((2, 3)).astype(np.float32)[:, ::2],  # not contiguous
    ]


def _check(device: str) -> None:
    staging = PinnedStaging(device)
    first = _arrays(0)
    got = staging.upload(first)
    for _ in range(3):  # both buffers refilled, the first result must not change
        staging.upload(_arrays(1))
    big = [np.arange(5000, dtype=np.int64)]  # past the buffer: it grows
    assert staging.upload(big)[0].cpu().tolist() == big[0].tolist()
    for t, a in zip(got, first, strict=True):
        assert t.device.type == torch.device(device).type
        assert t.dtype == torch.from_numpy(np.ascontiguousarray(a)).dtype
        assert tuple(t.shape) == a.shape
        assert np.array_equal(t.cpu().numpy(), a)


def test_staging_packs_every_dtype_and_shape_without_aliasing():
    _check("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_staging_on_gpu():
    _check("cuda")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_sampling_tensors_through_the_staging(device):
    """Every optional column present (penalties, filters, min_tokens): the values land."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    params = [
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, seed=3,
                       presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.2,
                       min_tokens=4, stop_token_ids=[7]),
        SamplingParams(temperature=0),
    ]  # fmt: skip
    t = SamplingTensors.from_params(
        params, prompt_token_ids=[[1, 2, 3], [4]], output_token_ids=[[5], [6, 8]],
        vocab_size=50, eos_token_ids=[0], device=device,
    )  # fmt: skip
    assert t.temperature.tolist() == pytest.approx([0.7, 1.0])
    assert t.is_greedy.tolist() == [False, True]
    assert t.top_k.tolist() == [5, 50] and t.top_p.tolist() == pytest.approx([0.9, 1.0])
    assert t.min_p.tolist() == pytest.approx([0.05, 0.0])
    assert t.presence_penalty.tolist() == [0.5, 0.0]
    assert t.frequency_penalty.tolist() == [0.25, 0.0]
    assert t.repetition_penalty.tolist() == pytest.approx([1.2, 1.0])
    assert t.output_token_ids.tolist() == [[5, 50], [6, 8]]
    assert t.prompt_token_ids.tolist() == [[1, 2, 3], [4, 50, 50]]
    assert t.blocked_token_ids.tolist() == [[0, 7], [50, 50]]  # row 1: no min_tokens
    assert t.positions.tolist() == [4, 3]


def _check_fields(device: str) -> None:
    """Fields land at the start of ``into`` (a graph's static inputs) from the same buffer;
    with no other arrays, or only empty ones, nothing else is copied."""
    staging = PinnedStaging(device)
    into = torch.full((16,), -1, dtype=torch.int64, device=device)
    fields = [np.array([3, 1, 4]), np.array([1, 5], dtype=np.int32).astype(np.int64)]
    arrays = [np.array([9, 2, 6], dtype=np.int64), np.array([True, False])]
    got = staging.upload(arrays, into, fields)
    assert into.cpu().tolist() == [3, 1, 4, 1, 5] + [-1] * 11
    assert got[0].cpu().tolist() == [9, 2, 6] and got[1].cpu().tolist() == [True, False]
    only = staging.upload([np.zeros(0, dtype=np.int64)] * 2, into, [np.array([7, 7])])
    assert [t.numel() for t in only] == [0, 0] and only[0].device.type == into.device.type
    empties = staging.upload([np.zeros((0, 3), dtype=np.int32), np.zeros(0, dtype=bool)])
    assert [(tuple(t.shape), t.dtype) for t in empties] == [
        ((0, 3), torch.int32),
        ((0,), torch.bool),
    ]
    assert into.cpu().tolist()[:3] == [7, 7, 4]
    staging.upload([], into, [np.array([8], dtype=np.int32)])  # widened to into's int64
    assert into.cpu().tolist()[:2] == [8, 7]
    with pytest.raises(TypeError, match="Cannot cast"):  # a field that into cannot hold
        staging.upload([], into, [np.array([1.5])])


def test_staging_fields_into_a_device_tensor():
    _check_fields("cpu")


def test_staging_of_one_8_byte_dtype_packs_back_to_back():
    """A step's inputs (1-D int64 arrays, some empty, with fields): one concatenate, one
    split; every value lands, and a later upload does not overwrite an earlier result."""
    staging = PinnedStaging("cpu")
    into = torch.full((8,), -1, dtype=torch.int64)
    rng = np.random.default_rng(0)
    sizes = [3, 0, 1, 7, 0, 2]
    first = [rng.integers(-(2**40), 2**40, size=n) for n in sizes]
    got = staging.upload(first, into, [np.array([5, 6])])
    for _ in range(3):
        staging.upload([rng.integers(0, 9, size=n) for n in sizes], into, [np.array([1, 2])])
    assert [t.tolist() for t in got] == [a.tolist() for a in first]
    assert all(t.dtype == torch.int64 and t.ndim == 1 for t in got)
    floats = staging.upload([np.array([0.5, -1.0]), np.array([2.0])])  # float64: one split
    assert [t.tolist() for t in floats] == [[0.5, -1.0], [2.0]]
    assert [t.numel() for t in staging.upload([np.zeros(0, dtype=np.int64)] * 3)] == [0, 0, 0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_staging_fields_on_gpu():
    _check_fields("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_step_buffers_upload_through_the_staging():
    """StepBuffers on a GPU: arrays and a graph's static fields from one staging, many
    uploads in flight behind a busy stream do not overwrite each other."""
    buffers = StepBuffers([], BlockTables({"kv": 4}, 2, 64), "cuda")
    static = StaticInputs(64, "cuda")
    spin = torch.randn(4096, 4096, device="cuda")
    results = []
    for k in range(6):
        spin @ spin  # keeps the stream busy while the next uploads are packed
        (dev,) = buffers.upload([np.arange(k, k + 5)], static.buffer, [np.full(3, k)])
        results.append((k, dev, static.buffer[:3].clone()))
    torch.cuda.synchronize()
    for k, dev, head in results:
        assert dev.tolist() == list(range(k, k + 5)) and head.tolist() == [k] * 3


class _Fence:
    """A stand-in for a buffer's CUDA event that logs what is done with it."""

    def __init__(self, log: list, i: int) -> None:
        self.log, self.i = log, i

    def record(self) -> None:
        self.log.append(("record", self.i))

    def synchronize(self) -> None:
        self.log.append(("wait", self.i))


def test_fences_are_recorded_after_the_launch_and_waited_for_before_reuse():
    """The fence of an upload is recorded by ``fence()`` (after the work that reads it),
    or else by the next upload before it fills its buffer; a buffer is refilled only after
    waiting on the fence recorded after its last copy; an upload that copies nothing needs
    no fence."""
    staging = PinnedStaging("cpu")
    log: list = []
    staging._fences = [_Fence(log, i) for i in range(staging.BUFFERS)]
    into = torch.zeros(4, dtype=torch.int64)
    staging.upload([np.arange(3)])  # buffer 0
    assert log == [("wait", 0)]  # nothing recorded between the copy and the launch
    staging.fence()
    staging.fence()  # no upload since: nothing more
    assert log[1:] == [("record", 0)]
    del log[:]
    staging.upload([], into, [np.array([5])])  # buffer 1, fields only; left unfenced
    staging.upload([np.arange(2)])  # buffer 2: records buffer 1's fence first
    assert log == [("wait", 1), ("record", 1), ("wait", 2)]
    del log[:]
    staging.upload([np.zeros(0, dtype=np.int64)])  # buffer 0 again: copies nothing
    staging.upload([np.arange(4)])  # buffer 1
    assert log == [("record", 2), ("wait", 0), ("wait", 1)]
    assert into.tolist() == [5, 0, 0, 0]
