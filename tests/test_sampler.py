"""The sampler's filters against brute force on small vocabularies."""

import torch

from batchrun.engine.core.sequence import SamplingParams, Sequence
from batchrun.engine.worker.sampler import sample


def seqs_for(params_list, seed=0):
    out = []
    for i, p in enumerate(params_list):
        s = Sequence(i, [1], p)
        s.generator = torch.Generator().manual_seed(seed + i)
        out.append(s)
    return out


def test_greedy_rows_take_the_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0], [5.0, 0.0, 4.9]])
    assert sample(logits, seqs_for([SamplingParams(), SamplingParams()])) == [1, 0]


def test_top_k_and_top_p_only_draw_from_the_allowed_set():
    torch.manual_seed(0)
    logits = torch.randn(1, 50)
    order = logits[0].argsort(descending=True).tolist()
    probs = logits[0].softmax(-1)
    # top-p 0.5: the smallest prefix of the sorted tokens whose mass reaches 0.5
    cum, nucleus = 0.0, []
    for t in order:
        nucleus.append(t)
        cum += probs[t].item()
        if cum >= 0.5:
            break
    for seed in range(200):
        k = sample(logits, seqs_for([SamplingParams(temperature=1.0, top_k=3)], seed))[0]
        assert k in order[:3]
        p = sample(logits, seqs_for([SamplingParams(temperature=1.0, top_p=0.5)], seed))[0]
        assert p in nucleus
    # with top_k 1 or a tiny top_p, sampling is greedy
    assert sample(logits, seqs_for([SamplingParams(temperature=0.7, top_k=1)]))[0] == order[0]
    assert sample(logits, seqs_for([SamplingParams(temperature=0.7, top_p=1e-6)]))[0] == order[0]


def test_draws_follow_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    seq = seqs_for([SamplingParams(temperature=1.0)])[0]
    counts = [0, 0, 0]
    for _ in range(3000):
        counts[sample(logits, [seq])[0]] += 1
    assert abs(counts[0] / 3000 - 0.7) < 0.04 and abs(counts[2] / 3000 - 0.1) < 0.03
