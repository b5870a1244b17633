"""A prepacked linear computes what `nn.Linear` does and gives its weights back on unpacking, in
float32 (which oneDNN packs on every x86 CPU) and in bfloat16 where this CPU's oneDNN packs it."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from models import packed_linear
from models.packed_linear import FEW_ROWS, ROW_STREAMS, PackedLinear, can_pack, pack, unpack

# How far a layer's output may be from `nn.Linear`'s: float32 sums in another order; bfloat16 rounds.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def dtypes() -> list[torch.dtype]:
    return [d for d in (torch.float32, torch.bfloat16) if can_pack(torch.device("cpu"), d)]


@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_linear_computes_what_the_plain_one_does(dtype, bias):
    torch.manual_seed(0)
    plain = nn.Linear(96, 160, bias=bias).to(dtype)
    packed = PackedLinear(plain)
    with torch.inference_mode():
        for shape in ((96,), (1, 96), (1, 1, 96), (1, 7, 96), (3, 5, 96)):  # decodes, a prefill, a padded batch
            x = torch.randn(shape, dtype=dtype)
            torch.testing.assert_close(packed(x), plain(x), rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    assert torch.equal(packed.unpacked().weight, plain.weight)


def test_pack_and_unpack_swap_every_linear_and_back():
    if not dtypes():
        pytest.skip("this torch has no oneDNN")
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4, bias=False)))
    weights = [m.weight.clone() for m in model.modules() if isinstance(m, nn.Linear)]
    assert pack(model) == 2 and not any(type(m) is nn.Linear for m in model.modules())
    assert unpack(model) == 2
    assert all(torch.equal(a, m.weight) for a, m in zip(weights, [m for m in model.modules() if isinstance(m, nn.Linear)]))


@pytest.mark.parametrize("dtype", dtypes())
def test_a_compiled_step_of_up_to_few_rows_reads_the_plain_weight_and_computes_what_the_layer_does(dtype):
    """A graph compiled for one row, or for up to FEW_ROWS, computes the layer as inductor's own
    reductions over the plain weight (no call of a library kernel in the code it generates); a
    graph for more rows calls the packed kernel."""
    from torch._inductor.utils import run_and_get_code
    torch.manual_seed(0)
    plain = nn.Linear(96, 160, bias=True).to(dtype)
    packed = PackedLinear(plain)
    with torch.inference_mode():
        for rows, packed_call in ((1, False), (3, False), (FEW_ROWS, False), (FEW_ROWS + 1, True)):
            torch._dynamo.reset()
            x = torch.randn(rows, 1, 96, dtype=dtype)
            out, code = run_and_get_code(torch.compile(packed, fullgraph=True), x)
            torch.testing.assert_close(out, plain(x), rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
            code = "".join(code)
            assert ("packed_linear" in code) == packed_call and "mkl" not in code


@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("rows, loop", [(160, 160 // ROW_STREAMS), (97, 97)])
def test_a_compiled_one_row_step_streams_several_row_blocks_in_one_loop_and_sums_each_row_alike(rows, loop, dtype,
                                                                                                monkeypatch):
    """One row's step reads the weight in ROW_STREAMS equal blocks through one loop (its bound is a
    block's rows), and each output is the sum that reading one row at a time gives, bit for bit;
    a row count with no such divisor (a prime) reads in one stream."""
    from torch._inductor.utils import run_and_get_code
    torch.manual_seed(0)
    packed = PackedLinear(nn.Linear(96, rows, bias=False).to(dtype))
    x = torch.randn(1, 1, 96, dtype=dtype)
    outs = {}
    with torch.inference_mode():
        for streams in (1, ROW_STREAMS):
            monkeypatch.setattr(packed_linear, "ROW_STREAMS", streams)
            torch._dynamo.reset()
            outs[streams], code = run_and_get_code(torch.compile(packed, fullgraph=True), x)
    assert f"x0<static_cast<int64_t>({loop}L)" in "".join(code)
    assert torch.equal(outs[1], outs[ROW_STREAMS])


@pytest.mark.parametrize("dtype", dtypes())
def test_a_compiled_step_of_a_few_rows_reads_each_weight_once_for_all_of_them_on_their_normed_values(dtype):
    """The rows' reductions over the weight run as one loop with an accumulator per row (each
    weight element loaded once for all the rows), over the rows as computed before it: the norm
    that feeds the layer runs once, not again for every weight element (its square root stays out
    of the reduction). The output is the layer's on the normed rows."""
    from torch._inductor.utils import run_and_get_code
    torch.manual_seed(0)
    norm, plain = nn.RMSNorm(96).to(dtype), nn.Linear(96, 160, bias=False).to(dtype)
    model = nn.Sequential(norm, PackedLinear(plain))
    x = torch.randn(3, 1, 96, dtype=dtype)
    with torch.inference_mode():
        torch._dynamo.reset()
        out, code = run_and_get_code(torch.compile(model, fullgraph=True), x)
        torch.testing.assert_close(out, plain(norm(x)), rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    code = "".join(code)
    kernel = code[code.index("x0<static_cast<int64_t>(160L)"):]
    loop = kernel[:kernel.index("\n}\n")]   # to the end of the generated function
    assert "tmp_acc2_vec" in loop and "tmp_acc3_vec" not in loop   # three rows, one loop over the weight
    assert "sqrt" not in loop
