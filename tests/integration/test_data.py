"""The bijection order holds no permutation: ShardedGlobalSampler(order="bijection") over 10**8 samples peaks
at a block of indices (under 4 MiB), as over 10**6, where a permutation would be 800 MB."""

from ddplab.data import ShardedGlobalSampler


def test_the_bijection_order_holds_no_permutation_however_many_samples():
    import tracemalloc

    peaks = {}
    for n in (10**6, 10**8):  # 800 MB of permutation at 10**8 samples
        s = ShardedGlobalSampler(n, 64, 2, 0, seed=0, order="bijection")
        tracemalloc.start()
        for k, _ in enumerate(s):
            if k == 32 * 2000:
                break
        peaks[n] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peaks[10**8] < 4 * 2**20 and peaks[10**8] < 1.2 * peaks[10**6], peaks  # a block of indices, not n
