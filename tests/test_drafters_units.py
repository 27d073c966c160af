"""MTP / Eagle3 / DSpark drafters, piece by piece: registry, checkpoints, HF's MTP as an oracle, capturable
draft steps, the guide's refusals, self-distillation training and its command line.

Whole runs (lossless for every method and topology, graph mode, P/D) are in test_drafters_lossless.py.
"""

from __future__ import annotations

import functools
import warnings
import json
import os

import pytest
import torch
from spec_methods_cases import Recorder

from cpattn.config import ConfigError
from cpattn.drafters import cache as kv
from cpattn.drafters import dspark as dsp
from cpattn.drafters import eagle3 as e3
from cpattn.drafters import mtp as mt
from cpattn.lab import sequence as sq
from cpattn.lab import target as tg
from cpattn.lab.corpus import Corpus
from cpattn.lab.train import main as train_main
from cpattn.lab.train import target_main, train_drafter
from cpattn.engine.dense_cache import DenseKVCache
from cpattn.drafters.draft_model import ModelDrafter
from cpattn.drafters.ngram import NgramDrafter
from cpattn.drafters.registry import DRAFTERS
from cpattn.engine.drafters import DraftSettings, TargetHidden, check_drafter, speculative_fields
from cpattn.graphs.check import check_static
from cpattn.models import deepseek_v3, deepseek_v32, qwen3
from cpattn.models.generate import pcp_dcp_config, pcp_dcp_generate, speculative_generate

pytestmark = pytest.mark.usefixtures("one_thread")


def qwen_target(dtype=torch.float64):
    cfg = qwen3.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=2, head_dim=8)
    return cfg, qwen3.init_params(cfg, seed=0, std=0.3, dtype=dtype)


def mla_target(dtype=torch.float64):
    cfg = deepseek_v3.DeepseekV3Config.tiny()
    return cfg, deepseek_v3.init_params(cfg, seed=1, dtype=dtype)


def test_registry_names_every_drafter():
    assert sorted(DRAFTERS) == ["draft_model", "dspark", "eagle3", "mtp", "ngram"]
    assert {n: DRAFTERS[n].method for n in DRAFTERS} == {n: n for n in DRAFTERS}
    assert DRAFTERS["ngram"] is NgramDrafter and DRAFTERS["draft_model"] is ModelDrafter
    with pytest.raises(KeyError, match="unknown drafter 'medusa'; known"):
        DRAFTERS["medusa"]


def test_draft_cache_attends_only_its_key_range():
    """Keys outside [lo, hi) never count, whatever they hold (NaN included); an empty range gives 0."""
    g = torch.Generator().manual_seed(0)
    k = torch.randn(3, 9, 2, 4, generator=g)
    v = torch.randn(3, 9, 2, 4, generator=g)
    k[:, 6:] = float("nan")  # rows past every range
    q = torch.randn(3, 4, 4, generator=g)  # 4 query heads over 2 KV heads
    req, lo, hi = torch.tensor([0, 1, 1]), torch.tensor([0, 2, 0]), torch.tensor([6, 5, 0])
    out = kv.attend(q, k, v, req, lo, hi, 0.5)
    for n in range(2):
        kk = k[req[n], lo[n]:hi[n]].repeat_interleave(2, 1)  # [S, 4, D]
        vv = v[req[n], lo[n]:hi[n]].repeat_interleave(2, 1)
        w = torch.softmax(torch.einsum("hd,shd->hs", q[n], kk) * 0.5, -1)
        assert torch.allclose(out[n], torch.einsum("hs,shd->hd", w, vv), atol=1e-6)
    assert torch.equal(out[2], torch.zeros(4, 4))


# -- checkpoints -----------------------------------------------------------------------------------


def test_eagle3_and_dspark_checkpoints_round_trip(tmp_path):
    cfg, params = qwen_target(torch.float32)
    for d in (e3.Eagle3Drafter.random(params, cfg, vocab=list(range(3, 40)), seed=1),
              dsp.DSparkDrafter.random(params, cfg, block_size=3, mask_token_id=63, num_layers=2, seed=2)):
        path = tmp_path / d.method
        d.save(path)
        back = DRAFTERS[d.method].from_checkpoint(path)
        assert back.cfg == d.cfg and sorted(back.params) == sorted(d.params)
        assert all(torch.equal(back.params[n], d.params[n]) for n in d.params)
    with pytest.raises(ValueError, match="is not an Eagle3 head"):
        DRAFTERS["eagle3"].from_checkpoint(tmp_path / "dspark")


def test_eagle3_maps_draft_ids_to_target_ids():
    cfg, params = qwen_target(torch.float32)
    vocab = [5, 9, 40, 41]
    d = e3.Eagle3Drafter.random(params, cfg, vocab=vocab)
    assert e3.to_target(d.params, torch.arange(4)).tolist() == vocab
    assert torch.equal(d.params["lm_head.weight"], params["lm_head.weight"][vocab])


def test_mtp_loads_from_a_deepseek_checkpoint(tmp_path):
    """Only ``model.layers.{N}.*`` is read, per-expert names are stacked; without its own embedding and head
    the module takes the target's (as HF shares them)."""
    cfg, params = mla_target(torch.float32)
    d = mt.MTPDrafter.random("deepseek_v3", cfg, target_params=params, seed=3, std=0.1)
    full = {**params, **{n: t for n, t in d.params.items()
                         if not n.endswith(("embed_tokens.weight", "shared_head.head.weight"))}}
    tg.save(tmp_path, "deepseek_v3", cfg, full)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    back = mt.MTPDrafter.from_checkpoint(tmp_path)
    assert sorted(back.params) == sorted(d.params) and back.layer == 2
    assert all(torch.equal(back.params[n], d.params[n]) for n in d.params)
    d.save(tmp_path / "alone", config)  # the module alone, with its own embedding and head copies
    alone = mt.MTPDrafter.from_checkpoint(tmp_path / "alone")
    assert all(torch.equal(alone.params[n], d.params[n]) for n in d.params)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="declares no MTP module"):
        mt.MTPDrafter.from_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="MTP drafts for DeepSeek-format"):
        mt.MTPDrafter("qwen3", d.params, cfg)


def test_mtp_loads_from_a_glm5_checkpoint(tmp_path):
    """GLM-5 (glm_moe_dsa) checkpoints carry the same module at ``model.layers.{N}.*``; HF's GLM-5 config has
    no MTP field, the release's config.json sets ``num_nextn_predict_layers``."""
    from cpattn.drafters import checkpoint
    from cpattn.models import glm_moe_dsa

    transformers = pytest.importorskip("transformers")
    hf = transformers.GlmMoeDsaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=32,
                                      qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, moe_intermediate_size=16,
                                      n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
                                      index_topk=4, index_head_dim=16, index_n_heads=2, index_topk_pattern="FS")
    config = {**hf.to_dict(), "num_nextn_predict_layers": 1}
    cfg = glm_moe_dsa.GlmMoeDsaConfig.from_hf(config)
    params = glm_moe_dsa.init_params(cfg, seed=0)
    d = mt.MTPDrafter.random("glm_moe_dsa", cfg, target_params=params, seed=1, std=0.1)
    checkpoint.save(tmp_path, checkpoint.unstack_experts({**params, **d.params}), config)
    back = mt.MTPDrafter.from_checkpoint(tmp_path)
    assert (back.model, back.layer) == ("glm_moe_dsa", 2) and back.cfg == cfg
    assert sorted(back.params) == sorted(d.params)
    assert all(torch.equal(back.params[n], d.params[n]) for n in d.params)


# -- HF's MTP as the oracle ----------------------------------------------------------------------


def target_hidden(model, params, cfg, seq: list[int], layers: tuple) -> dict:
    """The target's hidden states of a whole sequence (one dense prefill)."""
    from cpattn.engine.family import get_family

    fam = get_family(model)
    cache = DenseKVCache.empty(fam.kv_layouts(cfg), batch=1, max_len=len(seq),
                               dtype=params["model.embed_tokens.weight"].dtype)
    return fam.forward(params, cfg, torch.tensor(seq), cache.step([len(seq)]), hidden_layers=layers)


@pytest.mark.slow  # a Hugging Face round trip: the full suite runs it, the fast lane does not
def test_mtp_drafts_equal_hf_mtp(tmp_path, monkeypatch):
    """HF's ``generate(use_mtp=True)`` on a DeepSeek-V3 checkpoint whose MTP module our drafter wrote: every
    round, our draft state (fed the rounds' hidden rows) proposes HF's candidate, with HF's logits; and the
    engine's speculative decoding with k = 1 proposes HF's candidates in the same rounds and emits HF's tokens."""
    transformers = pytest.importorskip("transformers")
    from hf_oracle import perturbed
    from safetensors.torch import load_file, save_file
    from transformers.generation.candidate_generator import MTPCandidateGenerator

    from cpattn.drafters import checkpoint
    from cpattn.models import load_checkpoint

    hc = transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=1, max_position_embeddings=64, initializer_range=0.2,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "beta_fast": 32, "beta_slow": 1},
        num_mtp_layers=1, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    perturbed(transformers.DeepseekV3ForCausalLM, hc, 0).save_pretrained(tmp_path)
    config, params = load_checkpoint(tmp_path, dtype=torch.float64)
    cfg = deepseek_v3.DeepseekV3Config.from_hf(config)
    mtp = mt.MTPDrafter.random("deepseek_v3", cfg, target_params=params, seed=5, std=0.2)
    g = torch.Generator().manual_seed(9)
    mtp = mt.MTPDrafter("deepseek_v3", {n: t + 0.1 * torch.randn(t.shape, generator=g, dtype=t.dtype)
                                        if "norm" in n else t for n, t in mtp.params.items()}, cfg)
    file = os.path.join(tmp_path, "model.safetensors")
    state = load_file(file)
    state.update({n: t.float().contiguous() for n, t in checkpoint.unstack_experts(mtp.params).items()})
    save_file(state, file, metadata={"format": "pt"})
    # HF looks for DeepSeek-V3's layer 61; our tiny model's module is layer 2
    monkeypatch.setattr(transformers.DeepseekV3ForCausalLM, "_keys_to_ignore_on_load_unexpected",
                        [r"model\.layers\.2.*"])
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float64,
                                                            attn_implementation="eager",
                                                            experts_implementation="eager").eval()
    log = []
    orig = MTPCandidateGenerator.get_candidates

    def record(self, input_ids, *a, **kw):
        ids, logits = orig(self, input_ids, *a, **kw)
        if ids.shape[1] > input_ids.shape[1]:
            log.append((input_ids.shape[1], ids[0, input_ids.shape[1]:].tolist(), logits[0, -1]))
        return ids, logits

    monkeypatch.setattr(MTPCandidateGenerator, "get_candidates", record)
    prompt = torch.randint(0, 128, (1, 9), generator=g)
    with torch.no_grad():
        seq = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False,
                          use_mtp=True, pad_token_id=0)[0].tolist()
    assert len(log) >= 10
    ours = mt.MTPDrafter.from_checkpoint(tmp_path, dtype=torch.float64)
    _, hidden = target_hidden("deepseek_v3", params, cfg, seq, ())
    norm = hidden["norm"]  # [S, H]
    state = ours.start(1, len(seq) + 2)
    held = 0
    bcfg = mt.block_config(cfg)
    for length, drafts, hf_logits in log:
        rows = TargetHidden({"norm": norm[None, held:length - 1]}, (held,), (length - 1 - held,))
        assert state.propose([seq[:length]], 1, [0], rows).tolist() == [drafts]
        held = length - 1
        # the module's logits at the last row, recomputed without a cache, against HF's candidate logits
        def attend(q, lat, scale):
            n = lat.shape[0]
            return sq.masked_attention(q, lat, lat[..., :cfg.kv_lora_rank],
                                       torch.ones(n, n, dtype=torch.bool).tril(), scale)

        logits, _ = mt.mtp_logits_features(ours.params, bcfg, ours.layer, torch.tensor(seq[1:length]),
                                           norm[:length - 1], torch.arange(1, length), attend)
        # HF hands its candidate logits over in float32: agreement to float32 rounding
        assert torch.allclose(logits[-1], hf_logits.double(), rtol=0, atol=1e-6 * float(hf_logits.abs().max()))
        state.rollback([0], [length - 1])
    rec = Recorder(ours)
    out = speculative_generate("deepseek_v3", params, cfg, [seq[:9]], 12, drafter=rec, num_speculative_tokens=1,
                               dcp_size=2)
    assert out.tokens[0].tolist() == seq[9:]
    rounds = {len(h[0]): d[0] for h, d in rec.log}  # history length -> drafts (both ranks: the same)
    assert [rounds.get(length) for length, _, _ in log] == [d for _, d, _ in log]


# -- capturable draft steps -------------------------------------------------------------------------


def chain_batches(width: int, rows: int, requests: int, max_len: int) -> list[dict]:
    out = []
    for s in range(2):
        g = torch.Generator().manual_seed(s)
        pos = torch.randint(0, max_len, (rows,), generator=g)
        out.append({"tokens": torch.randint(0, 64, (rows,), generator=g),
                    "features": torch.randn(rows, width, generator=g),
                    "req": torch.randint(0, requests + 1, (rows,), generator=g), "pos": pos,
                    "lo": torch.randint(0, 2, (rows,), generator=g), "hi": pos + 1})
    return out


@pytest.mark.slow
def test_draft_steps_are_capturable():
    """Each method's draft step compiles once (fullgraph, static shapes) and replays equal to eager."""
    cfg, params = qwen_target(torch.float32)
    e = e3.Eagle3Drafter.random(params, cfg, draft_vocab=48, std=0.3)
    check_static(functools.partial(e3.eagle3_step, cfg=e.cfg), e.start(3, 16).state, chain_batches(32, 6, 3, 16))
    mcfg, mparams = mla_target(torch.float32)
    m = mt.MTPDrafter.random("deepseek_v3", mcfg, target_params=mparams, std=0.1)
    check_static(functools.partial(mt.mtp_step, cfg=mt.block_config(mcfg), layer=m.layer), m.start(3, 16).state,
                 chain_batches(64, 6, 3, 16))
    d = dsp.DSparkDrafter.random(params, cfg, block_size=4, mask_token_id=63, std=0.3)
    batches = []
    for s in range(2):
        g = torch.Generator().manual_seed(s)
        batches.append({"features": torch.randn(6, 96, generator=g), "req": torch.randint(0, 3, (6,), generator=g),
                        "pos": torch.randint(0, 16, (6,), generator=g),
                        "anchor": torch.randint(0, 64, (2,), generator=g),
                        "start": torch.randint(0, 16, (2,), generator=g), "row": torch.tensor([0, 2]),
                        "lo": torch.zeros(2, dtype=torch.int64)})
    check_static(functools.partial(dsp.dspark_step, cfg=d.cfg), d.start(3, 16).state, batches)


# -- the guide's refusals -------------------------------------------------------------------------------


def test_the_guide_refuses_with_pcp():
    """One engine with PCP and strict_guide=True: each constraint of the guide names its field and fix. Without
    strict_guide they are compatibility notes (docs/compat.md); the settings cpattn's drafters do not implement
    are refused by the drafter check under every layout."""
    cfg, params = qwen_target()
    mcfg, mparams = mla_target()
    d32 = deepseek_v32.DeepseekV32Config.tiny()
    p32 = deepseek_v32.init_params(d32, seed=2, dtype=torch.float64)
    eagle = e3.Eagle3Drafter.random(params, cfg, dtype=torch.float64)
    spark = dsp.DSparkDrafter.random(params, cfg, block_size=2, mask_token_id=63, dtype=torch.float64)
    mtp = mt.MTPDrafter.random("deepseek_v3", mcfg, target_params=mparams, dtype=torch.float64)
    mtp32 = mt.MTPDrafter.random("deepseek_v32", d32, target_params=p32, dtype=torch.float64)
    prompts = [[1, 2, 3]]

    def one_engine(model, p, c, drafter, strict=True):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the opted-in engine's compatibility note
            config = pcp_dcp_config(model, c, 2)
            if strict:  # the opted-in engine is refused too; the drafter's own rule is listed with it
                config.replace(strict_guide=True, num_speculative_tokens=2, **speculative_fields(drafter))
        return pcp_dcp_generate(model, p, c, prompts, 4, config=config, drafter=drafter, num_speculative_tokens=2)

    cases = [
        (qwen3, params, cfg, mtp, r"speculative_method: saw 'mtp' .* Eagle3 for GQA"),
        (qwen3, params, cfg, spark, r"speculative_method: saw 'dspark' .*fix: use speculative_method in \['eagle3'\]"),
        (deepseek_v3, mparams, mcfg, eagle, r"speculative_method: saw 'eagle3' .* MTP for MLA"),
        (deepseek_v3, mparams, mcfg, mt.MTPDrafter(mtp.model, mtp.params, mcfg, DraftSettings(draft_sampling="random")),
         r"draft_sampling: saw 'random' with pcp_size=2; rule: vLLM-Ascend's engine refuses it: with PCP draft "
         "sampling must be greedy"),
        (deepseek_v32, p32, d32, mt.MTPDrafter(mtp32.model, mtp32.params, d32, DraftSettings(draft_attention="sfa")),
         r"draft_attention: saw 'sfa' with pcp_size=2; rule: vLLM-Ascend's engine refuses it: PCP speculative "
         "decoding does not support SFA draft"),
        (deepseek_v3, mparams, mcfg, mt.MTPDrafter(mtp.model, mtp.params, mcfg,
                                                   DraftSettings(adaptive_verification=True)),
         r"adaptive_verification: saw True with pcp_size=2; rule: vLLM-Ascend's engine refuses it: PCP "
         "speculative decoding does not support"),
        (qwen3, params, cfg, dsp.DSparkDrafter(spark.params, spark.cfg, DraftSettings(dynamic_draft_length=True)),
         r"dynamic_draft_length: saw True with pcp_size=2; rule: vLLM-Ascend's engine refuses it: a dynamic draft "
         "length is not validated"),
    ]
    for model, p, c, drafter, message in cases:
        with pytest.raises(ConfigError, match=message):
            one_engine(model, p, c, drafter)
    # without strict_guide the guide's settings rules are notes; cpattn's drafter check refuses what it lacks
    with pytest.raises((ValueError, RuntimeError), match="cpattn's drafters draft greedily"):  # (raised in a rank)
        one_engine(deepseek_v3, mparams, mcfg, cases[3][3], strict=False)
    # no PCP: the guide allows these, cpattn's drafters do not implement them
    for settings, message in ((DraftSettings(draft_sampling="random"), "cpattn's drafters draft greedily"),
                              (DraftSettings(draft_attention="sfa"), "attend densely"),
                              (DraftSettings(dynamic_draft_length=True), "verifies a fixed k")):
        with pytest.raises(ValueError, match=message):
            check_drafter(dsp.DSparkDrafter(spark.params, spark.cfg, settings), 2)
    with pytest.raises(ValueError, match="num_speculative_tokens=5 > the DSpark block size 2"):
        spark.start(1, 8).propose([[1, 2]], 5, [0], TargetHidden({}, (0,), (1,)))


# -- training ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_data():
    """A random tiny Qwen3 and DeepSeek-V3 with greedy continuations of corpus prompts (seconds)."""
    corpus = Corpus.make(32, seed=0)
    out = {}
    for model in ("qwen3", "deepseek_v3"):
        cfg = tg.tiny_config(model, vocab_size=32, hidden_size=32, num_layers=4 if model == "qwen3" else 2)
        params = tg.init(model, cfg, seed=0)
        layers = () if model == "deepseek_v3" else (0, 1, 2)
        out[model] = (cfg, params, tg.greedy_data(model, params, cfg, corpus.sample(8, 6, seed=1), 16, layers))
    return out


@pytest.mark.slow  # training: the full suite runs it, the fast lane does not
@pytest.mark.parametrize("method", ["mtp", "eagle3", "dspark"])
def test_training_lowers_the_loss(method, tiny_data):
    model = "deepseek_v3" if method == "mtp" else "qwen3"
    cfg, params, data = tiny_data[model]
    d, losses, acc = train_drafter(method, model, cfg, params, data, seconds=0, seed=0, depth=2, block_size=3,
                                   batch=4, lr=1e-2, max_steps=16)
    assert len(losses) == 16 and losses[-1] < 0.95 * losses[0]
    assert len(acc) == (3 if method == "dspark" else 2)
    frozen = [n for n in d.params if n.endswith("embed_tokens.weight")]
    assert frozen and all(torch.equal(d.params[n].float(), params["model.embed_tokens.weight"]) for n in frozen)


def test_greedy_data_is_the_targets_greedy_continuation(tiny_data, one_device):
    cfg, params, data = tiny_data["qwen3"]
    ref = one_device("qwen3", params, cfg, data.tokens[:2, :6].tolist(), 10).tokens
    assert torch.equal(data.tokens[:2, 6:], ref)
    assert torch.equal(data.greedy[:, 5:-1], data.tokens[:, 6:])


def test_corpus_has_its_phrases():
    c = Corpus.make(48, seed=3)
    x = c.sample(4, 40, seed=5)
    assert torch.equal(x, c.sample(4, 40, seed=5)) and not torch.equal(x, c.sample(4, 40, seed=6))
    assert int(x.min()) >= 1 and int(x.max()) <= 46
    text = " ".join(map(str, x[0].tolist()))
    assert sum(" ".join(map(str, p)) in text for p in c.phrases) >= 3


@pytest.mark.slow
def test_train_draft_command(tmp_path, capsys):
    """Exit 2 with one line for bad input; a short run writes a checkpoint the registry's drafter loads, the
    loss curve and train.json."""
    assert target_main(["--model", "qwen3", "--out", str(tmp_path / "t"), "--seconds", "1", "--vocab", "32",
                        "--hidden", "32", "--layers", "2"]) == 0
    assert (tmp_path / "t" / "corpus.json").exists() and (tmp_path / "t" / "loss.png").exists()
    capsys.readouterr()  # train-target's phase lines
    for argv, message in (
            (["--method", "eagle3", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "o")],
             "argument --model: saw"),
            (["--method", "mtp", "--model", str(tmp_path / "t"), "--out", str(tmp_path / "o")],
             "argument --method: saw 'mtp' for a qwen3 target"),
            (["--method", "dspark", "--model", str(tmp_path / "t"), "--out", str(tmp_path / "o"), "--seconds", "0"],
             "argument --seconds")):
        with pytest.raises(SystemExit) as e:
            train_main(argv)
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and len(err.splitlines()) == 1 and message in err
    out = tmp_path / "dspark"
    assert train_main(["--method", "dspark", "--model", str(tmp_path / "t"), "--out", str(out), "--seconds", "1",
                       "--prompts", "4", "--length", "24", "--block-size", "2"]) == 0
    assert (out / "loss.png").exists() and json.loads((out / "train.json").read_text())["steps"] >= 1
    assert DRAFTERS["dspark"].from_checkpoint(out).cfg.block_size == 2


def test_bench_drafts_acceptance_table():
    """``cpattn bench drafts``' acceptance part on the shipped checkpoints: a row per (target, method), lossless,
    tokens per verify step within 1 .. 1 + k, never more verify steps than plain decode steps."""
    from cpattn.lab import report

    rows = report.acceptance_rows(report.DEFAULT_DATA, 6, 2, [2])
    assert {(r["target"], r["method"]) for r in rows} == {(t, m) for t, ms in report.PAIRS.items() for m in ms}
    for r in rows:
        assert r["equal"] and 1 <= r["accept len"] <= 3 and r["verify steps"] <= r["plain steps"], r
        assert r["accepted/step"] == pytest.approx(r["accept len"] - 1)
