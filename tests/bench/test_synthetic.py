"""compress.bench.synthetic: the decode benchmarks' prompts are in the vocabulary, differ
from their first block on, and a later first index gives prompts no earlier call gave."""
from compress.bench.synthetic import synthetic_prompts


def test_prompts_are_distinct_and_in_the_vocabulary():
    a = synthetic_prompts(4096, 16, 20)
    b = synthetic_prompts(4096, 16, 20, first=16)
    assert len(a) == 16 and all(len(p) == 20 for p in a)
    assert all(5 <= t < 4096 - 5 for p in a + b for t in p)
    assert len({tuple(p[:16]) for p in a + b}) == 32   # no two share a 16-token block
    assert synthetic_prompts(4096, 2, 20, first=3)[0] == a[3]
