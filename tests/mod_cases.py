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
