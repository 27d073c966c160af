"""Two-server P/D: a ``kv_producer`` server and a ``kv_consumer`` server sharing ``--kv-pool lmdb:DIR``.

vLLM's disaggregated-prefill client flow, with the real ``openai`` client: each request goes to the
producer with ``max_tokens=1`` (it prefills -- PCP 2 here -- and stores the prompt's whole KV blocks
in the pool; two gloo rank processes, ``mp``), then unchanged to the consumer (DCP 2, ``mp`` too), which
fetches those blocks, computes the tail and decodes. Greedy tokens equal one device's, a seeded
sampled request equals the thread-mesh engine's and the one-process P/D server's engine's (token i is
a function of the logits, the seed and i), and ``/metrics`` shows the KV crossing the pool: blocks
stored by the producer, prompt tokens fetched by the consumer. Then the same through
``python -m cpattn.serve.proxy`` (one endpoint; vLLM's disaggregated-prefill proxy shape).
"""

from __future__ import annotations

import sys
import time

import pytest
from serve_helpers import ids as _ids
from test_serve_flags import Served, _free_port, _greedy, _metrics, embedded, needs_serving  # noqa: F401
from test_serve_ranks import _thread_mesh_tokens

NAME = "cpattn-qwen3"
LONG = [2, 71, 82, 81, 82, 84, 59, 4, 5, 23, 53, 60, 28, 74, 71, 35, 26, 62, 31, 7, 9, 11, 13, 17, 19, 21, 23, 29]
SHORT = [3, 14, 15, 92, 65, 35, 89, 79, 32]


def _role(role: str, pool: str, argv: list[str]) -> Served:
    port = _free_port()
    kv = f'{{"kv_connector": "CpattnPoolConnector", "kv_role": "{role}"}}'
    return Served([sys.executable, "-m", "cpattn", "serve", "--model-type", "qwen3", "--block-size", "4",
                   "--max-num-batched-tokens", "8", "--max-num-seqs", "4", "--max-model-len", "256",
                   "--kv-transfer-config", kv, "--kv-pool", pool, *argv, "--port", str(port)], port)


@pytest.mark.slow
@needs_serving
def test_producer_then_consumer_serves_one_device_tokens(tmp_path, embedded):
    from cpattn.engine.llm import SamplingParams

    pool = f"lmdb:{tmp_path / 'pool'}"
    producer = _role("kv_producer", pool, ["--pcp", "2", "--dcp", "2", "--distributed-executor-backend", "mp"])
    try:
        consumer = _role("kv_consumer", pool, ["--dcp", "2", "--distributed-executor-backend", "mp"])
    except BaseException:
        producer.stop()
        raise
    try:
        pc, cc = producer.client(), consumer.client()

        def disagg(prompt, n, **kw):  # the client flow: prefill on the producer, then the whole request
            first = _ids(pc.completions.create(model=NAME, prompt=prompt, max_tokens=1, **kw).choices[0])
            return first, _ids(cc.completions.create(model=NAME, prompt=prompt, max_tokens=n, **kw).choices[0])

        for prompt, n in ((LONG, 6), (SHORT, 5)):
            first, got = disagg(prompt, n, temperature=0)
            assert got == _greedy(embedded, prompt, n) and first == got[:1], (prompt, first, got)
        m_p, m_c = _metrics(producer.base), _metrics(consumer.base)
        # on real ranks each rank stores its own blocks (block j on rank j % 2) and rank 0's /metrics counts its own
        assert m_p["cpattn_kv_pool_blocks_stored_total"] == sum(-(-(len(p) // 4) // 2) for p in (LONG, SHORT)), m_p
        assert m_p["cpattn_pcp_steps_total"] > 0, m_p  # the producer's prefills ran PCP
        # the consumer fetched every whole block but the one holding the last prompt token (recomputed)
        assert m_c["cpattn_kv_pool_hit_tokens_total"] == (len(LONG) - 1) // 4 * 4 + (len(SHORT) - 1) // 4 * 4, m_c
        assert m_c["cpattn_kv_pool_blocks_stored_total"] == 0, m_c  # a consumer only fetches
        ask = dict(temperature=1.0, top_p=0.9, seed=11)
        first, got = disagg(LONG[::-1], 6, **ask)
        want = SamplingParams(max_tokens=6, **ask)
        assert got == _thread_mesh_tokens(embedded, LONG[::-1], want) == _one_process_pd(embedded, LONG[::-1], want)
        stream = cc.completions.create(model=NAME, prompt=LONG[::-1], max_tokens=6, stream=True, **ask)
        assert sum((_ids(c.choices[0]) for c in stream if c.choices), []) == got
        _through_the_proxy(producer, consumer, embedded)
    finally:
        codes = (consumer.stop(), producer.stop())
        assert codes == (0, 0), (consumer.proc.stderr.read(), producer.proc.stderr.read())


def _one_process_pd(embedded, prompt, params) -> list[int]:
    """The tokens of the engine the one-process P/D server runs (kv_both: PCP 2 prefill -> DCP 2 decode)."""
    from cpattn.config import SchedulerConfig
    from cpattn.engine.outputs import drain
    from cpattn.engine.pd_engine import PDEngine

    family, cfg, p = embedded
    engine = PDEngine(family, p, cfg, pcp_size=2, dcp_size=2, block_size=4,
                      scheduler=SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4, max_model_len=256))
    try:
        return list(drain(engine, [prompt], params)[0].token_ids)
    finally:
        engine.close()


def _through_the_proxy(producer: Served, consumer: Served, embedded) -> None:
    """``python -m cpattn.serve.proxy`` in front of the pair: the same flow for a client of one endpoint."""
    import openai

    port = _free_port()
    proxy = Served([sys.executable, "-m", "cpattn.serve.proxy", "--prefill", producer.base.split("//")[1],
                    "--decode", consumer.base.split("//")[1], "--port", str(port)], port)
    try:
        client = proxy.client()
        assert [m.id for m in client.models.list().data] == [NAME]
        prompt = SHORT + LONG[:11]  # 20 tokens, new to both servers
        steps, before = _metrics(producer.base)["cpattn_steps_total"], _metrics(consumer.base)
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=5, temperature=0)
        assert _ids(r.choices[0]) == _greedy(embedded, prompt, 5)
        chunks = [_ids(c.choices[0]) for c in client.completions.create(
            model=NAME, prompt=prompt[::-1], max_tokens=4, stream=True, temperature=0) if c.choices]
        assert sum(chunks, []) == _greedy(embedded, prompt[::-1], 4) and len(chunks) == 4
        assert _metrics(producer.base)["cpattn_steps_total"] > steps  # the prefills ran on the producer
        after = _metrics(consumer.base)
        pool, device = (after[k] - before[k] for k in ("cpattn_kv_pool_hit_tokens_total",
                                                        "cpattn_prefix_hit_tokens_total"))
        assert pool + device == 2 * 16 and pool >= 16, (pool, device)  # 4 blocks each; SHORT's 2 were on device
        with pytest.raises(openai.BadRequestError) as e:  # the producer's 400, passed through
            client.completions.create(model=NAME, prompt=[1, 2, 512], max_tokens=2)
        assert "outside the vocabulary" in e.value.body["message"]
        aborted = _metrics(consumer.base)["cpattn_aborted_requests_total"]
        impatient = openai.OpenAI(base_url=proxy.base + "/v1", api_key="x", max_retries=0, timeout=1.0)
        with pytest.raises(openai.APITimeoutError):  # a plain request given up: the proxy hangs up on the consumer
            impatient.completions.create(model=NAME, prompt=SHORT[::-1], max_tokens=240, temperature=0)
        deadline = time.monotonic() + 30
        while (m := _metrics(consumer.base))["cpattn_aborted_requests_total"] < aborted + 1:
            assert time.monotonic() < deadline, m
            time.sleep(0.1)
        assert m["cpattn_kv_blocks_used"] == 0 and m["cpattn_running_requests"] == 0, m
    finally:
        assert proxy.stop() == 0, proxy.proc.stderr.read()
