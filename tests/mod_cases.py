"""The front ends' programmable-attention cases (tests/test_torch_mods.py,
tests/test_jax_mods.py): the traced functions, their call shapes and built-in options."""
from cuflash import mod

RADIUS = 4  # the relative bias's buckets: distances -RADIUS .. RADIUS
BATCH, SEQLEN_Q, SEQLEN_K, NHEADS, NHEADS_KV, HEADDIM = 2, 13, 17, 4, 2, 8


def relative_bias(score, b, h, q_idx, kv_idx, bias):
    return score + bias[h, mod.minimum(mod.maximum(q_idx - kv_idx, -RADIUS), RADIUS) + RADIUS]


def same_document(b, h, q_idx, kv_idx, doc_q, doc_k):
    return doc_q[b, q_idx] == doc_k[b, kv_idx]


def softcap(score, b, h, q_idx, kv_idx):
    return 2.0 * mod.tanh(score / 2.0)


def biased_documents(score, b, h, q_idx, kv_idx, bias, doc_q, doc_k):
    return relative_bias(score, b, h, q_idx, kv_idx, bias)


def documents_beside_a_bias(b, h, q_idx, kv_idx, bias, doc_q, doc_k):
    return same_document(b, h, q_idx, kv_idx, doc_q, doc_k)


# case: (score_mod, mask_mod, built-in options)
CASES = {
    "bias": (relative_bias, None, {"causal": True}),
    "document": (None, same_document, {}),
    "softcap": (softcap, None, {"window_size": (5, 3)}),
    "both": (biased_documents, documents_beside_a_bias, {"softcap": 3.0}),
}


# Block masks (cuflash.mod.create_block_mask): lengths past two 128 x 128 blocks, ragged, so
# that the statuses hold empty and partial blocks (and full ones, but for the window).
BLOCK_SEQLEN_Q, BLOCK_SEQLEN_K = 300, 280
WINDOW = 100  # keys a query of the sliding window sees


def causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx + (BLOCK_SEQLEN_K - BLOCK_SEQLEN_Q)


def sliding_window(b, h, q_idx, kv_idx):
    distance = q_idx + (BLOCK_SEQLEN_K - BLOCK_SEQLEN_Q) - kv_idx
    return (distance >= 0) & (distance < WINDOW)


# case: (score_mod, mask_mod, built-in options); "document" takes the mod tensors of CASES["both"]
# (bias, doc_q, doc_k), which score_mod reads from the block mask too
BLOCK_CASES = {
    "causal": (None, causal, {}),
    "document": (biased_documents, documents_beside_a_bias, {}),
    "window": (softcap, sliding_window, {"softcap": 3.0}),
}


def other_documents(b, h, q_idx, kv_idx, bias, doc_q, doc_k):  # the same mask, another function
    return same_document(b, h, q_idx, kv_idx, doc_q, doc_k)


def block_mask_misuses(made, block_mask) -> list:
    """(call arguments, error, message) for block masks that do not fit a "document" block
    case's call, in every front end: made for other shapes (``made(batch=, heads=,
    seqlen_q=, seqlen_k=)`` builds one), or beside another mask_mod."""
    return [
        (dict(block_mask=made(seqlen_q=BLOCK_SEQLEN_Q - 1)), ValueError,
         f"block_mask was made for seqlen_q {BLOCK_SEQLEN_Q - 1}, this call has {BLOCK_SEQLEN_Q}"),
        (dict(block_mask=made(seqlen_k=BLOCK_SEQLEN_K - 1)), ValueError, "block_mask was made for seqlen_k"),
        (dict(block_mask=made(heads=2)), ValueError, f"block_mask was made for heads 2, this call has {NHEADS}"),
        (dict(block_mask=made(batch=1)), ValueError, f"block_mask was made for batch 1, this call has {BATCH}"),
        (dict(block_mask=block_mask, mask_mod=other_documents), ValueError, "mask_mod must be block_mask's own"),
    ]
