"""The torch-native paged backend against a slow reference that walks block tables token by token."""

import math
import random

import pytest
import torch
from kernel_levels import at_path, kernel_paths
from requirements_here import require_kernels

from pagedllm.attention import AttentionMetadata, PagedAttention
from pagedllm.kernels import cpu_kernels, use_kernel_config
from pagedllm.kernels.attention import prompt_attention_amx
from pagedllm.kernels.codes import CHUNKED_KERNEL


def reference_attention(query, k_cache, v_cache, block_table, positions, num_heads, num_kv_heads, window=None,
                        soft_cap=None, sinks=None):
    """For each query at absolute position p: attend to slots of positions 0..p (p - window + 1..p
    with a window), one token at a time; scores soft-capped as cap * tanh(s / cap) with a cap; with
    ``sinks`` ([num_heads]) each head's sink logit one more score of the softmax, with no value."""
    block_size = k_cache.shape[1]
    group = num_heads // num_kv_heads
    head_dim = k_cache.shape[-1]
    out = torch.zeros(len(positions), num_heads, head_dim, dtype=torch.float64)
    for qi, pos in enumerate(positions):
        keys, values = [], []
        for p in range(max(0, pos - window + 1) if window else 0, pos + 1):
            block = block_table[p // block_size]
            keys.append(k_cache[block, p % block_size].double())
            values.append(v_cache[block, p % block_size].double())
        keys, values = torch.stack(keys), torch.stack(values)  # [L, Hkv, D]
        for h in range(num_heads):
            kv_head = h // group
            scores = keys[:, kv_head] @ query[qi, h].double() / math.sqrt(head_dim)
            if soft_cap:
                scores = soft_cap * torch.tanh(scores / soft_cap)
            if sinks is not None:
                probs = torch.softmax(torch.cat((scores, sinks[h : h + 1].double())), 0)[:-1]
            else:
                probs = torch.softmax(scores, 0)
            out[qi, h] = probs @ values[:, kv_head]
    return out


def _make_case(seed, kind, num_heads=4, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=64, released=False):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim)
    # With released blocks, block 0 (what a released entry reads as) holds huge values that would
    # show in any output that read them.
    free = list(range(1 if released else 0, num_blocks))
    if released:
        k_cache[0] = v_cache[0] = 1e4
    rng.shuffle(free)  # physical blocks anywhere in the pool
    seqs = []
    for _ in range(rng.randint(1, 4)):
        if kind == "mixed":  # decodes and prompt chunks after any cached context, tiles of 8 and more
            kind_of_seq = rng.choice(["prefill", "decode", "chunk"])
        else:
            kind_of_seq = kind
        if kind_of_seq == "prefill":
            cached, new = rng.choice([0, 0, block_size, 2 * block_size]), rng.randint(1, 9)
        elif kind_of_seq == "decode":
            cached, new = rng.randint(1, 20), 1
        else:
            cached, new = rng.randint(1, 30), rng.randint(2, 21)
        total = cached + new
        table = [free.pop() for _ in range(-(-total // block_size))]
        seqs.append((cached, new, table))
    return k_cache, v_cache, seqs


def case_metadata(seqs, block_size: int, window=None):
    """(meta, query starts, positions per sequence, slots) of a case's step: each sequence's new
    tokens after its cached ones, written through its block table."""
    slots, starts, positions_per_seq = [], [0], []
    for cached, new, table in seqs:
        positions = list(range(cached, cached + new))
        positions_per_seq.append(positions)
        slots += [table[p // block_size] * block_size + p % block_size for p in positions]
        starts.append(starts[-1] + new)
    max_blocks = max(len(t) for _, _, t in seqs)
    # As the block manager does with a window: blocks wholly before the first query's window are
    # released, their entries read as block 0.
    tables = [
        [0 if window and b < max(0, cached - window + 1) // block_size else block for b, block in enumerate(t)]
        for cached, _, t in seqs
    ]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_lens=[new for _, new, _ in seqs],
        query_start_loc=starts,
        context_lens=torch.tensor([c + n for c, n, _ in seqs]),
        block_tables=torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables]),
        num_cached_tokens=[c for c, _, _ in seqs],
        max_context_len=max(c + n for c, n, _ in seqs),
    )
    return meta, starts, positions_per_seq, slots


def sink_logits(num_heads: int, seed: int) -> torch.Tensor:
    """Sinks far from zero, as trained ones are (exp(sink) of the order of the scores' sum): a kernel
    that ignores them fails every comparison."""
    return torch.randn(num_heads, generator=torch.Generator().manual_seed(1000 + seed)) * 2


def _run(seed, kind, use_cpu_kernel=True, head_dim=8, window=None, soft_cap=None, dtype=torch.float32,
         sinks=False) -> torch.Tensor:
    """The layer's output for one random case, checked against the token-by-token reference."""
    num_heads, num_kv_heads, block_size = 4, 2, 4
    k_cache, v_cache, seqs = _make_case(seed, kind, head_dim=head_dim, released=window is not None)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    total_new = sum(new for _, new, _ in seqs)
    query = torch.randn(total_new, num_heads * head_dim).to(dtype)
    key = torch.randn(total_new, num_kv_heads * head_dim).to(dtype)
    value = torch.randn(total_new, num_kv_heads * head_dim).to(dtype)
    meta, starts, positions_per_seq, slots = case_metadata(seqs, block_size, window)
    attn = PagedAttention(num_heads, head_dim, num_kv_heads, 1 / math.sqrt(head_dim), window, soft_cap, sinks)
    sink_values = sink_logits(num_heads, seed) if sinks else None
    if sinks:
        attn.sinks.copy_(sink_values)
    attn.use_cpu_kernel = use_cpu_kernel
    out = attn(query, key, value, (k_cache, v_cache), meta).view(total_new, num_heads, head_dim)
    # The reference writes through slot_mapping by hand, token by token.
    for i, slot in enumerate(slots):
        ref_k[slot // block_size, slot % block_size] = key[i].view(num_kv_heads, head_dim)
        ref_v[slot // block_size, slot % block_size] = value[i].view(num_kv_heads, head_dim)
    assert torch.equal(ref_k, k_cache) and torch.equal(ref_v, v_cache)
    q = query.view(total_new, num_heads, head_dim)
    for i, (_, _, table) in enumerate(seqs):
        start, end = starts[i], starts[i + 1]
        expected = reference_attention(q[start:end], ref_k, ref_v, table, positions_per_seq[i], num_heads, num_kv_heads,
                                       window, soft_cap, sink_values)
        # bfloat16: the output is rounded to 8 bits of mantissa (the inputs are exact in both).
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[start:end].double(), expected, atol=tol, rtol=tol)
    return out


@pytest.mark.parametrize("path", kernel_paths())
def test_prefill_matches_reference(path):
    with at_path(path):
        for seed in range(8):
            _run(seed, "prefill", use_cpu_kernel=path != "torch")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [8, 32, 64, 96, 128, 256])
@pytest.mark.parametrize("path", kernel_paths())
def test_decode_matches_reference(path, head_dim, dtype):
    """Head sizes 32, 64, 96, 128 and 256 take the kernel's register loops (AVX-512 or AVX2, float32
    and bfloat16), 8 the generic loop; at every level, the torch path too."""
    with at_path(path) as level:
        for seed in range(8):
            _run(seed, "decode", use_cpu_kernel=path != "torch", head_dim=head_dim, dtype=dtype)
        if level is not None:
            level.assert_ran("paged_decode_attention")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_kv_heads, threads", [(3, 4), (4, 3), (2, 2)])
@pytest.mark.parametrize("path", kernel_paths()[1:])
def test_decode_splits_heads_when_sequences_are_fewer_than_threads(path, num_kv_heads, threads, dtype):
    """Fewer sequences than threads: the decode kernel splits a sequence's KV heads into ranges, one
    per thread (here of uneven sizes, and one left empty with 4 heads over 3 threads). Every row
    decoded alone equals, bit for bit, the same row in a batch of more sequences than threads (no
    split), and the reference; over float32 rows and float16 ones (cache dtype float16)."""
    from pagedllm.kernels.attention import paged_decode_attention

    gen = torch.Generator().manual_seed(num_kv_heads * 10 + threads)
    num_heads, head_dim, block_size, seqs = 2 * num_kv_heads, 64, 4, 6
    k_cache = torch.randn(64, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(64, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    tables = torch.randperm(64, generator=gen)[: seqs * 8].view(seqs, 8)
    lens = torch.randint(1, 8 * block_size + 1, (seqs,), generator=gen)
    query = torch.randn(seqs, num_heads, head_dim, generator=gen)
    scale = head_dim ** -0.5
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with at_path(path) as level:
            batched = paged_decode_attention(query, k_cache, v_cache, tables, lens, scale)
            alone = [
                paged_decode_attention(query[i : i + 1], k_cache, v_cache, tables[i : i + 1], lens[i : i + 1], scale)
                for i in range(seqs)
            ]
            level.assert_ran("paged_decode_attention")
    finally:
        torch.set_num_threads(previous)
    for i in range(seqs):
        assert torch.equal(alone[i][0], batched[i]), f"sequence {i}: alone differs from batched"
        expected = reference_attention(query[i : i + 1], k_cache, v_cache, tables[i], [int(lens[i]) - 1],
                                       num_heads, num_kv_heads)
        torch.testing.assert_close(alone[i].double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [8, 64])
@pytest.mark.parametrize("invariant", [True, False])
@pytest.mark.parametrize("path", kernel_paths())
def test_mixed_batch_matches_reference(path, head_dim, invariant):
    """Decodes and prompt chunks in one batch: the torch path (gathering) and the C++ kernels
    (reading blocks in place, at every level: every row as a decode under batch invariance, the
    chunked kernel without it) against attention computed token by token."""
    with at_path(path) as level, use_kernel_config(batch_invariant=invariant):
        for seed in range(8):
            _run(seed, "mixed", use_cpu_kernel=path != "torch", head_dim=head_dim)
        if level is not None:
            _assert_mixed_kernel_ran(level, invariant)


def _assert_mixed_kernel_ran(level, invariant: bool) -> None:
    level.assert_ran("paged_decode_attention" if invariant else "paged_chunked_attention")
    if invariant:
        level.assert_not_ran("paged_chunked_attention")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_chunks_after_context_through_sdpa(monkeypatch, dtype, without_batch_invariance):
    """Every multi-token chunk after a cached context routed to torch's SDPA over its gathered
    context (the CPU path does this from SDPA_MIN_CHUNK tokens on), decodes still through the kernel."""
    import pagedllm.attention.backend as backend

    monkeypatch.setattr(backend, "SDPA_MIN_CHUNK", 2)
    monkeypatch.setattr(backend, "AMX_MAX_CHUNK_PAIRS", 0)  # bfloat16 chunks would go to the AMX kernel
    for seed in range(8):
        for head_dim in (8, 64):
            _run(seed, "mixed", use_cpu_kernel=True, head_dim=head_dim, dtype=dtype)


@pytest.mark.parametrize("window", [None, 5])
def test_bf16_sdpa_lengths_are_padded_to_the_cpu_block(monkeypatch, window, without_batch_invariance):
    """bfloat16 prompts and chunks reach torch's CPU SDPA padded to a multiple of its block (its
    tails are slow), and the padding changes nothing: padded keys unseen, padded queries dropped."""
    import pagedllm.attention.backend as backend

    monkeypatch.setattr(backend, "SDPA_MIN_CHUNK", 2)
    monkeypatch.setattr(backend, "AMX_MAX_CHUNK_PAIRS", 0)
    lengths = []
    sdpa = backend.F.scaled_dot_product_attention

    def recording_sdpa(q, k, v, **kwargs):
        lengths.append((q.shape[2], k.shape[2]))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(backend.F, "scaled_dot_product_attention", recording_sdpa)
    for seed in range(8):
        _run(seed, "mixed", use_cpu_kernel=True, head_dim=64, window=window, dtype=torch.bfloat16)
    assert lengths and all(q % backend.SDPA_CPU_BLOCK == 0 and k % backend.SDPA_CPU_BLOCK == 0 for q, k in lengths)


@pytest.mark.kernels(level="amx")
@pytest.mark.parametrize("window", [None, 40])
def test_bf16_prompt_chunks_on_amx_tiles(monkeypatch, window, without_batch_invariance):
    """Mixed batches in bfloat16 with every prompt chunk on the AMX kernel (a window at least
    their span leaves them there), decodes on the chunked kernel, against the token-by-token
    reference; with a pair budget of 60, larger chunks go to SDPA in the same batches."""
    import pagedllm.attention.backend as backend

    monkeypatch.setattr(backend, "SDPA_MIN_CHUNK", 2)
    calls = []

    def recording_amx(query, *args):
        calls.append(query.shape[0])
        return prompt_attention_amx(query, *args)

    monkeypatch.setattr(backend, "prompt_attention_amx", recording_amx)
    for pairs in (backend.AMX_MAX_CHUNK_PAIRS, 60):
        monkeypatch.setattr(backend, "AMX_MAX_CHUNK_PAIRS", pairs)
        for seed in range(12):
            for head_dim in (64, 128):
                _run(seed, "mixed", use_cpu_kernel=True, head_dim=head_dim, window=window, dtype=torch.bfloat16)
    assert calls
    assert cpu_kernels().kernel_branches()["prompt_attention_amx"][0] == "amx"


@pytest.mark.kernels(level="amx")
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize(
    "block_size, num_heads, num_kv_heads, head_dim", [(16, 9, 3, 64), (4, 4, 4, 128), (8, 6, 1, 64)]
)
def test_amx_prompt_attention_long_chunks(block_size, num_heads, num_kv_heads, head_dim, with_sinks):
    """The tile kernel over prompts and chunks that span many 16-row and 64-key steps (lengths
    off every step), blocks scattered through the pool, against float64 attention; with sinks,
    each head's sink logit one more score of every row's softmax."""
    torch.manual_seed(0)
    chunks = [(0, 200), (100, 150), (37, 1), (64, 64), (0, 17), (250, 9)]  # (cached, new)
    lens = [c + n for c, n in chunks]
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(torch.bfloat16)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(torch.bfloat16)
    order = torch.randperm(num_blocks).tolist()
    max_blocks = max(-(-n // block_size) for n in lens)
    tables = torch.zeros(len(chunks), max_blocks, dtype=torch.long)
    for b, length in enumerate(lens):
        used = -(-length // block_size)
        tables[b, :used] = torch.tensor(order[:used])
        order = order[used:]
    starts = [0]
    for _, n in chunks:
        starts.append(starts[-1] + n)
    query = (torch.randn(starts[-1], num_heads, head_dim) * 2).to(torch.bfloat16)
    scale = head_dim**-0.5
    sinks = sink_logits(num_heads, 0) if with_sinks else None
    out = prompt_attention_amx(query, k_cache, v_cache, tables, torch.tensor(starts), torch.tensor(lens), scale, sinks)
    group = num_heads // num_kv_heads
    for b, (cached, _) in enumerate(chunks):
        k = k_cache[tables[b]].reshape(-1, num_kv_heads, head_dim)[: lens[b]].double().repeat_interleave(group, 1)
        v = v_cache[tables[b]].reshape(-1, num_kv_heads, head_dim)[: lens[b]].double().repeat_interleave(group, 1)
        q = query[starts[b] : starts[b + 1]].double()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        visible = torch.arange(lens[b])[None, :] <= torch.arange(cached, lens[b])[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        if with_sinks:
            sink_column = sinks.double().view(-1, 1, 1).expand(-1, scores.shape[1], 1)
            probs = torch.softmax(torch.cat((scores, sink_column), -1), -1)[..., :-1]
        else:
            probs = torch.softmax(scores, -1)
        expected = torch.einsum("hqk,khd->qhd", probs, v)
        # Probabilities multiply the values in bfloat16, the output is rounded to bfloat16.
        torch.testing.assert_close(out[starts[b] : starts[b + 1]].double(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("window, soft_cap", [(5, None), (None, 2.0), (8, 2.0)])
@pytest.mark.parametrize("invariant", [True, False])
@pytest.mark.parametrize("path", kernel_paths())
def test_mixed_batch_with_window_and_soft_cap(path, window, soft_cap, invariant):
    """Mixed batches through a sliding window (blocks before it released) and soft-capped scores."""
    with at_path(path) as level, use_kernel_config(batch_invariant=invariant):
        for seed in range(8):
            for head_dim in (8, 64):
                _run(seed, "mixed", use_cpu_kernel=path != "torch", head_dim=head_dim, window=window,
                     soft_cap=soft_cap)
        if level is not None:
            _assert_mixed_kernel_ran(level, invariant)


# ---------------------------------------------------------------- attention sinks (GPT-OSS)


def _sinks_kernels_equal_torch(seed: int, kind: str, **case) -> None:
    """One case of a layer with sinks through the C++ kernels and through the torch path (its
    explicit softmax with the sink as one more column): each equals the reference, and they equal
    each other to the same tolerance."""
    kernels = _run(seed, kind, use_cpu_kernel=True, sinks=True, **case)
    torch_path = _run(seed, kind, use_cpu_kernel=False, sinks=True, **case)
    tol = 1e-5 if case.get("dtype", torch.float32) == torch.float32 else 2e-2
    torch.testing.assert_close(kernels.double(), torch_path.double(), atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [8, 64])
@pytest.mark.parametrize("path", kernel_paths())
def test_decode_with_sinks(path, head_dim, dtype, window):
    """Decodes of a layer with sinks: the decode kernel at every level (heads of 64 on its AVX-512
    rows, of 8 on the portable loop) equals the reference and the torch path; the torch path
    equals the reference."""
    with at_path(path) as level:
        for seed in range(8):
            if level is None:
                _run(seed, "decode", use_cpu_kernel=False, head_dim=head_dim, window=window, dtype=dtype, sinks=True)
            else:
                _sinks_kernels_equal_torch(seed, "decode", head_dim=head_dim, window=window, dtype=dtype)
        if level is not None:
            level.assert_ran("paged_decode_attention")


@pytest.mark.parametrize("window, soft_cap", [(None, None), (5, None), (8, 2.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("invariant", [True, False])
@pytest.mark.parametrize("path", kernel_paths())
def test_mixed_batch_with_sinks(path, invariant, dtype, window, soft_cap):
    """Decodes and prompt chunks of a layer with sinks, with a window and a soft cap (the sink joins
    after the cap): every row through the decode kernel (batch invariance) or the chunked kernel
    (and, in bfloat16 on AMX, the tile kernel for prompts with nothing cached) equal the reference
    and the torch path."""
    with at_path(path) as level, use_kernel_config(batch_invariant=invariant):
        for seed in range(8):
            for head_dim in (8, 64):
                case = dict(head_dim=head_dim, window=window, soft_cap=soft_cap, dtype=dtype)
                if level is None:
                    _run(seed, "mixed", use_cpu_kernel=False, sinks=True, **case)
                else:
                    _sinks_kernels_equal_torch(seed, "mixed", **case)
        if level is not None:
            _assert_mixed_kernel_ran(level, invariant)


def test_sinks_leave_nothing_to_sdpa(without_batch_invariance):
    """torch's fused SDPA takes no sinks: a layer with sinks plans a float32 prompt (which SDPA
    serves without sinks) onto the chunked kernel."""
    k_cache, v_cache, _ = _make_case(0, "prefill")
    meta, *_ = case_metadata([(0, 9, [1, 2, 3]), (5, 1, [4, 5])], block_size=4)
    query = torch.empty(0, 4, 8)
    plain = PagedAttention(4, 8, 2, 0.5)
    assert plain.cpu_plan(meta, query, k_cache)[1] == (0,)
    with_sinks = PagedAttention(4, 8, 2, 0.5, sinks=True)
    assert with_sinks.cpu_plan(meta, query, k_cache) == ([(CHUNKED_KERNEL, meta)], ())


@pytest.mark.kernels(level="amx")
@pytest.mark.parametrize("window", [None, 40])
def test_bf16_prompt_chunks_with_sinks_on_amx_tiles(monkeypatch, window, without_batch_invariance):
    """bfloat16 prompt chunks of a layer with sinks on the AMX kernel, whatever their size (SDPA,
    which takes larger ones without sinks, has no sinks): equal to the reference and the torch path."""
    import pagedllm.attention.backend as backend

    monkeypatch.setattr(backend, "SDPA_MIN_CHUNK", 2)
    monkeypatch.setattr(backend, "AMX_MAX_CHUNK_PAIRS", 0)  # without sinks: every chunk to SDPA
    calls = []

    def recording_amx(query, *args):
        calls.append(query.shape[0])
        return prompt_attention_amx(query, *args)

    monkeypatch.setattr(backend, "prompt_attention_amx", recording_amx)
    for seed in range(12):
        for head_dim in (64, 128):
            _sinks_kernels_equal_torch(seed, "mixed", head_dim=head_dim, window=window, dtype=torch.bfloat16)
    assert calls


def test_cpu_kernel_builds_here():
    # The fused kernel is the CPU fast path; on this machine it must build, not silently fall back.
    require_kernels()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_write_kernel_matches_index_copy(dtype):
    """The one-call CPU scatter of keys and values: index_copy_'s result, from rows of a fused qkv
    output (strided tokens), from non-contiguous heads, and a clear error for a slot past the cache."""
    require_kernels()
    from pagedllm.attention import write_to_cache

    gen = torch.Generator().manual_seed(0)
    blocks, block_size, heads, dim, tokens = 6, 4, 3, 8, 5
    k_cache = torch.randn(blocks, block_size, heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(blocks, block_size, heads, dim, generator=gen).to(dtype)
    qkv = torch.randn(tokens, 4 * heads * dim, generator=gen).to(dtype)
    key = qkv[:, heads * dim : 2 * heads * dim].view(tokens, heads, dim)
    value = torch.randn(tokens, dim, heads, generator=gen).to(dtype).transpose(1, 2)  # heads not contiguous
    slots = torch.tensor([3, 17, 0, 23, 9])
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_k.view(-1, heads, dim).index_copy_(0, slots, key)
    expected_v.view(-1, heads, dim).index_copy_(0, slots, value)
    write_to_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    with pytest.raises(RuntimeError, match="outside the cache"):
        write_to_cache(key, value, k_cache, v_cache, torch.tensor([0, 1, 2, 3, blocks * block_size]))



def test_sub_batch_rows_are_a_slice_when_they_are_one_run():
    """A sub-batch whose rows are one run of the batch selects them with a slice (a view, no index
    gather or scatter per layer); scattered rows with an index tensor; both select the same rows."""
    query_lens = [1, 1, 5, 3]
    starts = [0, 1, 2, 7, 10]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(10),
        query_lens=query_lens,
        query_start_loc=starts,
        context_lens=torch.tensor([4, 6, 5, 9]),
        block_tables=torch.arange(8).view(4, 2),
        num_cached_tokens=[3, 5, 0, 6],
        max_context_len=9,
    )
    rows = torch.arange(10) * 10
    decodes = meta.decode_part
    assert isinstance(decodes.decode_rows, slice)
    assert rows[decodes.decode_rows].tolist() == [0, 10]
    prompts = meta.sub_batch((2, 3))
    assert isinstance(prompts.decode_rows, slice)
    assert rows[prompts.decode_rows].tolist() == [20, 30, 40, 50, 60, 70, 80, 90]
    assert prompts.slot_mapping.tolist() == list(range(2, 10)) and prompts.query_start_loc == [0, 5, 8]
    scattered = meta.sub_batch((0, 3))
    assert isinstance(scattered.decode_rows, torch.Tensor)
    assert rows[scattered.decode_rows].tolist() == [0, 70, 80, 90]
    assert scattered.context_lens.tolist() == [4, 9] and scattered.block_tables.tolist() == [[0, 1], [6, 7]]
