"""The gpt task's parts, in-process: the stdlib corpus (split, shards, cache, lock), the byte
tokenizer, the model presets, the device choice and the staged (GPU-path) exchange on the CPU."""
from __future__ import annotations

import hashlib
import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from peerd.train import DecentralizedOptimizer, LocalGroup
from peerd.train import corpus as cm
from peerd.train.device import (StagedExchange, ThreadEngine, _intersection_length, _union_length, chunk_ranges,
                                device_ranges, make_engine, resolve_device)
from peerd.train.gpt import GPT, PRESETS, param_count, preset
from peerd.train.lm import StdlibGPT, bits_per_byte, decode, encode
from peerd.train.tasks import get_task


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("corpus-cache")


@pytest.fixture(scope="module")
def corpus(cache) -> cm.Corpus:
    return cm.load(cache_dir=cache)


@pytest.fixture(scope="module")
def tiny(cache) -> StdlibGPT:
    return get_task("gpt", model_size="tiny", cache_dir=cache)


def test_corpus_is_the_stdlib_sources_without_test_suites(corpus):
    """Real text of some size, no test suite, no installed package, every file once, and the
    stream holds each file's bytes at its offset followed by the end-of-file byte."""
    paths = [f.path for f in corpus.files]
    assert len(paths) == len(set(paths)) > 300
    assert corpus.nbytes > 5_000_000
    for p in paths:
        parts = p.split("/")
        assert p.endswith(".py") and not set(parts[:-1]) & cm.EXCLUDED_DIRS, p
        assert not parts[-1].startswith("_sysconfigdata") and not parts[0].startswith("config-"), p
    assert "asyncio/events.py" in paths and "json/decoder.py" in paths
    assert not any(p.startswith(("test/", "idlelib/idle_test/", "lib2to3/tests/")) for p in paths)
    for f in corpus.files[:: max(1, len(corpus.files) // 25)]:
        raw = (corpus.root / f.path).read_bytes()
        assert bytes(corpus.data[f.offset:f.offset + f.length]) == raw + bytes([cm.EOF_BYTE]), f.path
    assert corpus.files[-1].offset + corpus.files[-1].length == corpus.nbytes
    assert hashlib.sha256(bytes(corpus.data)).hexdigest() == corpus.content_sha


def test_split_is_by_path_hash_deterministic_and_disjoint(corpus):
    train, val = corpus.split(False), corpus.split(True)
    assert {f.path for f in train}.isdisjoint(f.path for f in val)
    assert len(train) + len(val) == len(corpus.files)
    for f in corpus.files:   # recomputed independently: sha256 of the path, not Python's salted hash()
        h = int.from_bytes(hashlib.sha256(f.path.encode()).digest()[:8], "big")
        assert f.val == (h / 2 ** 64 < cm.VAL_FRACTION), f.path
    assert 0.02 < len(val) / len(corpus.files) < 0.10
    val_bytes = sum(f.length for f in val)
    assert 100_000 < val_bytes < 0.15 * corpus.nbytes
    assert max(f.length for f in val) < 0.5 * val_bytes, "one file is most of the validation set"


@pytest.mark.parametrize("non_iid", [False, True])
@pytest.mark.parametrize("world", [1, 4, 7])
def test_shards_partition_the_training_files(corpus, world, non_iid):
    train = corpus.split(False)
    shards = [corpus.shard(r, world, non_iid) for r in range(world)]
    seen = [f.path for s in shards for f in s]
    assert sorted(seen) == sorted(f.path for f in train) and len(seen) == len(set(seen))
    assert shards == [corpus.shard(r, world, non_iid) for r in range(world)]       # deterministic
    sizes = [sum(f.length for f in s) for s in shards]
    if not non_iid:    # bytes-balanced: within one file of each other
        assert max(sizes) - min(sizes) <= max(f.length for f in train)
    else:              # contiguous in path order: each shard is a run of directories
        for s in shards:
            ranks = [i for i, f in enumerate(sorted(train, key=lambda f: f.path)) if f in s]
            assert ranks == list(range(ranks[0], ranks[0] + len(ranks)))
    with pytest.raises(ValueError, match="outside"):
        corpus.shard(world, world)


def test_corpus_cache_is_found_again_and_rebuilt_the_same(corpus, tmp_path):
    again = cm.load(cache_dir=corpus.directory.parent)
    assert again.build_s == 0 and again.directory == corpus.directory
    fresh = cm.load(cache_dir=tmp_path)
    assert fresh.build_s > 0 and fresh.content_sha == corpus.content_sha and fresh.files == corpus.files


def test_four_processes_starting_together_build_the_cache_once(tmp_path):
    """The trainers of 4 hosts on one machine start together: one builds, three wait and reuse."""
    code = ("import json,sys; from pathlib import Path; from peerd.train import corpus as c; "
            "k = c.load(cache_dir=Path(sys.argv[1]), progress=lambda m: print('P', m, file=sys.stderr)); "
            "print(json.dumps([k.build_s, k.content_sha]))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    results = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    assert sum(1 for b, _ in results if b > 0) == 1, results
    assert len({sha for _, sha in results}) == 1
    assert sum("building the stdlib corpus" in e for _, e in outs) == 1
    assert len(list(tmp_path.glob("corpus-*/bytes.u8"))) == 1
    assert not list(tmp_path.glob("corpus-*/*.tmp*"))


def test_windows_stay_inside_their_files(tmp_path):
    """A training window may run from one shard file into the next of the same shard, never into
    another shard's or a validation file: each file here holds one letter, repeated."""
    root = tmp_path / "lib"
    letters = "abcdefghijklmnopqrstuvwxyz"
    for i, ch in enumerate(letters):
        d = root / ("pkg" if i % 3 else "") / ("test" if i == 5 else "")
        d.mkdir(parents=True, exist_ok=True)
        (d / f"m{i}.py").write_text(ch * (20 + 7 * i))
    (root / "bin.py").write_bytes(b"x\0y")                        # not text: left out
    c = cm.load(root=root, cache_dir=tmp_path / "cache")
    assert c.skipped == ["bin.py"] and not any("test/" in f.path for f in c.files)
    for rank in range(3):
        files = c.shard(rank, 3)
        allowed = {int(c.data[f.offset]) for f in files} | {cm.EOF_BYTE}
        w = cm.Windows(c.data, files, 16)
        x, y = w.sample(np.random.default_rng(rank), 400)
        assert set(torch.cat([x, y], 1).unique().tolist()) <= allowed
        assert torch.equal(x[:, 1:], y[:, :-1])


def test_byte_tokenizer_round_trips(corpus):
    s = "def f(x):\n    return 'π ≈ 3.14159' + \"\\t✓\"\n"
    assert decode(encode(s)) == s
    assert encode(s).dtype == torch.int64 and int(encode(s).max()) < 256
    raw = bytes(range(256)) + "é".encode("latin-1")                 # not UTF-8: bytes still round-trip
    assert bytes(encode(raw).tolist()) == raw
    f = corpus.files[len(corpus.files) // 2]
    text = (corpus.root / f.path).read_text(encoding="utf-8")
    assert decode(encode(text)) == text
    assert decode(torch.from_numpy(np.array(corpus.data[f.offset:f.offset + f.length - 1]))) == text


def test_presets_have_the_advertised_parameter_counts():
    counts = {}
    for name, cfg in PRESETS.items():
        model = GPT(cfg)
        n = sum(p.numel() for p in model.parameters())
        assert n == param_count(cfg), name
        counts[name] = n
        del model
    assert counts == {"tiny": 445_952, "small": 25_482_240, "base": 99_821_568}
    assert counts["small"] >= 25_000_000
    assert get_task("gpt").cfg == PRESETS["small"], "the default size is small"
    assert get_task("gpt", model_size="base").param_bytes() == 4 * 99_821_568
    assert param_count(preset("tiny", 64)) == 445_952 - 64 * 128
    with pytest.raises(ValueError, match="unknown model size"):
        get_task("gpt", model_size="huge")
    with pytest.raises(ValueError, match="takes no options"):
        get_task("digits", model_size="tiny")


def test_gpt_forward_is_causal_and_the_loss_starts_at_ln256():
    torch.manual_seed(0)
    model = GPT(preset("tiny"))
    x = torch.randint(0, 256, (2, 40))
    x2 = x.clone()
    x2[:, 30:] = torch.randint(0, 256, (2, 10))
    with torch.no_grad():
        a, b = model(x), model(x2)
    assert torch.allclose(a[:, :30], b[:, :30], atol=1e-5) and not torch.allclose(a[:, 30:], b[:, 30:])
    from peerd.train.gpt import lm_loss
    y = torch.randint(0, 256, (2, 40))
    assert abs(lm_loss(model, x, y).item() - np.log(256)) < 0.2
    with pytest.raises(ValueError, match="longer than the context"):
        model(torch.zeros(1, 129, dtype=torch.long))


def test_tiny_gpt_learns_locally_and_beats_the_unigram_baseline(tiny):
    """Two workers of the tiny model on a LocalGroup: the averaged model's validation loss falls
    from ln 256 (8 bits per byte) well below the unigram model of a shard (about 4.6)."""
    from peerd.train.tasks import train_local
    torch.set_num_threads(1)
    base = tiny.baseline(tiny.shard(0, 2))["unigram_bpb"]
    assert 4.0 < base < 5.5, base
    run = train_local(tiny, world=2, iterations=150, topology="complete", eval_every=50, batch_size=8)
    bpb = [h["bpb"] for h in run.history]
    assert run.history[0]["loss"] < np.log(256)
    assert bpb == sorted(bpb, reverse=True), bpb
    assert bpb[-1] < base - 0.5, (bpb, base)
    assert bits_per_byte(run.final["loss"]) == pytest.approx(run.final["bpb"])


def test_device_choice_on_a_machine_without_a_gpu():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == (torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA"):
            resolve_device("cuda")
    with pytest.raises(ValueError, match="unknown device"):
        resolve_device("tpu")
    assert make_engine(torch.device("cpu")) is None       # the CPU path copies nothing
    eng = make_engine(torch.device("cpu"), "thread")
    assert isinstance(eng, ThreadEngine)
    eng.close()


def test_interval_arithmetic_of_the_overlap_measure():
    assert _union_length([(0, 1), (0.5, 2), (3, 4)]) == pytest.approx(3.0)
    assert _intersection_length([(0, 2), (3, 5)], [(1, 4)]) == pytest.approx(2.0)
    assert _intersection_length([(0, 1)], [(1, 2)]) == 0.0
    assert chunk_ranges(1000, 300) == [(0, 256), (256, 512), (512, 768), (768, 1000)]

    class Seg:
        def __init__(self, offset, numel):
            self.offset, self.numel, self.dtype = offset, numel, torch.float32
    pieces = device_ranges([(0, 256), (256, 512)], [Seg(0, 100), Seg(448, 10)])
    assert pieces == [[(0, 0, 64)], [(0, 64, 100), (1, 0, 10)]]


def _train_pair(task, staged: bool, steps: int, chunk: int, rule: str, device: str = "cpu"):
    group = LocalGroup(2, "complete")
    dev = torch.device(device)
    models = [task.build(0).to(dev) for _ in range(2)]
    exchanges = [group.worker(r) for r in range(2)]
    if staged:
        engine = ThreadEngine if dev.type == "cpu" else (lambda: make_engine(dev))
        exchanges = [StagedExchange(e, dev, engine(), chunk_bytes=chunk) for e in exchanges]
    opts = []
    for m, e in zip(models, exchanges):   # two groups: two segments, so chunks straddle a segment edge
        decay = [p for p in m.parameters() if p.dim() >= 2]
        rest = [p for p in m.parameters() if p.dim() < 2]
        kw = dict(lr=3e-3, weight_decay=0.1) if rule == "adamw" else dict(lr=0.05, momentum=0.9)
        opts.append(DecentralizedOptimizer([{"params": decay}, {"params": rest, "weight_decay": 0.0}], e, rule, **kw))
    its = [task.batches(task.shard(r, 2), 4, seed=1) for r in range(2)]
    for _ in range(steps):
        for o in opts:
            o.zero_grad()
        for m, it in zip(models, its):
            task.loss(m, next(it)).backward()
        for o in opts:
            o.step()
    out = [o.flat.buffer.clone() for o in opts]
    times = [e.times for e in exchanges] if staged else None
    for e in exchanges:
        e.close()
    return out, times


@pytest.mark.parametrize("rule,chunk", [("adamw", 4096), ("sgd", 1 << 30)])
def test_staged_exchange_trains_exactly_as_the_plain_one(tiny, rule, chunk):
    """The GPU path's orchestration on the CPU: x_k copied out on a copy thread, the mix copied in
    by chunks and applied chunk by chunk. The parameters equal the plain path's bit for bit, and
    every iteration's copies and their overlap with compute are measured."""
    torch.set_num_threads(1)
    plain, _ = _train_pair(tiny, False, 5, chunk, rule)
    staged, times = _train_pair(tiny, True, 5, chunk, rule)
    assert all(torch.equal(a, b) for a, b in zip(plain, staged))
    for ts in times:
        assert [t.iteration for t in ts] == [0, 1, 2, 3]        # each read one iteration later
        for t in ts:
            assert t.d2h_s > 0 and t.h2d_s > 0 and t.compute_s > 0
            assert 0 <= t.overlap_s <= t.copy_s + 1e-9


def test_report_shows_validation_loss_and_bits_per_byte_of_lm_runs():
    from peerd.bench.report import table
    base = dict(scenario="straggler", target=0.8, it_per_s=2.0, idle_fraction=0.1, bytes_per_step=1e6,
                time_to_target_s=30.0, reached_target=True, unigram_bpb=4.55)
    recs = [dict(base, contender="ddp", final_eval_loss=1.40), dict(base, contender="hop", final_eval_loss=1.386294),
            dict(base, contender="hop", final_eval_loss=1.50)]
    out = table(recs)
    assert "final val loss / bpb (avg model)" in out
    assert "| 1.443 / 2.082 (unigram 4.55) |" in out        # hop: medians of 1.386 and 1.5 nats
    assert "final val loss" not in table([{k: v for k, v in r.items() if k != "final_eval_loss"} for r in recs])


def test_peerd_train_shows_bits_per_byte_for_the_gpt_task():
    from types import SimpleNamespace

    from cli.live import bits_per_byte, plain_line
    p = SimpleNamespace(iteration=50, loss=1.2, metric_name="loss", metric=1.3862944, iterations_per_s=3.0,
                        peers_in_last_mix=2, gap_to_fastest=0, skipped=0, elapsed_s=12.0, partial_mixes=0,
                        state="training")
    assert bits_per_byte("gpt", p) == pytest.approx(2.0)
    assert "val loss 1.386 (2.000 bits/byte)" in plain_line(p, 100, task="gpt")
    assert bits_per_byte("lm", p) is None and "bits/byte" not in plain_line(p, 100, task="lm")
    p.iteration, p.state = 99, "done"        # the last one published is 99 (0-based): all 100 done
    assert "] it 100/100 " in plain_line(p, 100) and "eta 0:00:00" in plain_line(p, 100)


def test_init_weights_from_a_state_dict_or_a_checkpoint(tmp_path):
    from peerd.train.warmstart import load_init
    src = GPT(preset("tiny"))
    torch.save(src.state_dict(), tmp_path / "w.pt")
    torch.save({"iteration": 7, "model": src.state_dict(), "optimizer": {}}, tmp_path / "latest.pt")
    for name in ("w.pt", "latest.pt"):
        torch.manual_seed(1)
        m = GPT(preset("tiny"))
        load_init(m, tmp_path / name)
        assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), src.state_dict().values()))
    with pytest.raises(RuntimeError, match="size mismatch"):
        load_init(GPT(preset("tiny", 64)), tmp_path / "w.pt")


def test_a_warm_start_carries_adams_moments_so_training_continues_where_it_stopped(tiny, tmp_path):
    """A warm start (peerd bench warm-start) of 4 Adam steps, then 3 more steps from the file, in
    DecentralizedOptimizer (one worker: the mix is the identity) and in DiLoCo's inner AdamW: both
    land where 7 uninterrupted steps of torch's Adam land. Without the moments they would not."""
    from peerd.train import warmstart
    from peerd.train.outer import OuterOptimizer
    from peerd.train.warmstart import load_init

    torch.set_num_threads(1)
    path = tmp_path / "warm.pt"
    meta = warmstart.make(tiny, 4, 2, path, eval_every=4, echo=lambda s: None)
    assert meta["steps"] == 4 and len(meta["evals"]) == 2
    d = tiny.defaults
    batches = list(itertools.islice(tiny.batches(tiny.shard(0, 1), 2, 0), 7))

    ref = tiny.build(0)
    opt = torch.optim.Adam(ref.parameters(), lr=d["lr"], betas=d["betas"])
    for b in batches:
        opt.zero_grad()
        tiny.loss(ref, b).backward()
        opt.step()

    def resumed(make_opt, moments: bool) -> nn.Module:
        model = tiny.build(1)                       # other weights: the file must replace them
        warm = load_init(model, path)
        o = make_opt(model, LocalGroup(1).worker(0))
        if moments:
            o.seed_moments(warm)
        for b in batches[4:]:
            o.zero_grad()
            tiny.loss(model, b).backward()
            o.step()
        return model

    def dec(model, ex):
        return DecentralizedOptimizer(model.parameters(), ex, "adam", lr=d["lr"], betas=d["betas"])

    def outer(model, ex):
        return OuterOptimizer(model.parameters(), ex, "adamw", lr=d["lr"], betas=d["betas"], inner_steps=100)

    for make_opt in (dec, outer):
        diff = max((p - q).abs().max().item() for p, q in zip(ref.parameters(), resumed(make_opt, True).parameters()))
        cold = max((p - q).abs().max().item() for p, q in zip(ref.parameters(), resumed(make_opt, False).parameters()))
        assert diff < 1e-5, (make_opt.__name__, diff)
        assert cold > 100 * diff + 1e-4, (make_opt.__name__, cold)


def test_a_warm_start_of_another_model_or_without_moments_is_named(tiny, tmp_path):
    from peerd.train import warmstart

    bare = tmp_path / "bare.pt"
    torch.save(tiny.build(0).state_dict(), bare)
    assert warmstart.load_init(tiny.build(0), bare) is None
    path = tmp_path / "warm.pt"
    warmstart.make(tiny, 1, 2, path, eval_every=1, echo=lambda s: None)
    other = get_task("gpt", model_size="tiny", context=64, cache_dir=tiny.cache_dir)
    with pytest.raises(RuntimeError, match="pos"):      # the weights of another context: named
        warmstart.load_init(other.build(0), path)
    with pytest.raises(ValueError, match="adam or adamw"):
        opt_model = tiny.build(0)
        DecentralizedOptimizer(opt_model.parameters(), LocalGroup(1).worker(0), "sgd", lr=0.1).seed_moments(
            warmstart.load_init(opt_model, path))
