"""lm-eval-harness (`lm_eval --model local-completions`) against a real decode server: a local
multiple-choice task (loglikelihood: echo + logprobs on /v1/completions) and a local generate_until
task, both defined here (no download), run to completion; each choice's loglikelihood as lm-eval
recorded it must be the tiny model's own, computed here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.byte_tokenizer import byte_tokenizer
from tests.servers import ROOT
from tests.test_http_fixtures import HttpServer

pytest_plugins = ["tests.test_reliability_fixtures", "tests.test_http_fixtures"]
pytestmark = pytest.mark.e2e  # starts server processes (make test-fast leaves it out)
pytest.importorskip("lm_eval")

DOCS = [{"question": "Two plus two is", "choices": [" four", " five", " six"], "answer": 0},
        {"question": "The sky is", "choices": [" blue", " green"], "answer": 0},
        {"question": "Water is", "choices": [" wet", " dry"], "answer": 1}]
CHOICE_TASK = """task: pd_tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
GEN_TASK = """task: pd_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def loglikelihood(context: str, continuation: str) -> float:
    """The tiny model's log probability of `continuation`'s bytes after `context`'s, prefilled here."""
    from engine.offline import make_runner

    runner = make_runner(preset="tiny", max_model_len=256)
    ids, cont = list(context.encode()), list(continuation.encode())
    total = 0.0
    for i, token in enumerate(cont):
        prefix = ids + cont[:i]
        table = runner.pool.allocator.allocate(runner.pool.blocks_needed(len(prefix)))
        try:
            total += float(torch.log_softmax(runner.prefill(prefix, table, 0).float(), -1)[token])
        finally:
            runner.pool.allocator.free(table)
    return total


def test_lm_eval_local_completions(http_server: HttpServer, tmp_path: Path) -> None:
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "choice.yaml").write_text(CHOICE_TASK.format(data=data))
    (tmp_path / "gen.yaml").write_text(GEN_TASK.format(data=data))
    byte_tokenizer()._hf.save_pretrained(tmp_path / "tokenizer")  # the tiny preset's, for lm-eval to count with
    args = (f"model=tiny,base_url={http_server.url}/completions,tokenizer={tmp_path / 'tokenizer'},"
            "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1")
    log_before = len(http_server.own_log())
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    done = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
                           "--tasks", "pd_tiny_choice,pd_tiny_gen", "--include_path", str(tmp_path),
                           "--output_path", str(tmp_path / "out"), "--log_samples"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())["results"]
    assert set(results) == {"pd_tiny_choice", "pd_tiny_gen"}
    choice = [json.loads(line) for line in next((tmp_path / "out").rglob("samples_pd_tiny_choice_*.jsonl")).open()]
    assert len(choice) == len(DOCS)
    for sample in choice:
        doc = sample["doc"]
        got = [float(resp[0][0]) for resp in sample["resps"]]  # [[loglikelihood, is_greedy]] a choice
        expected = [loglikelihood(doc["question"], " " + c) for c in doc["choices"]]  # lm-eval's target_delimiter
        assert got == pytest.approx(expected, abs=1e-3), doc
    generated = [json.loads(line) for line in next((tmp_path / "out").rglob("samples_pd_tiny_gen_*.jsonl")).open()]
    assert len(generated) == len(DOCS) and all(isinstance(s["resps"][0][0], str) for s in generated)
    assert "refused" not in http_server.own_log()[log_before:]  # lm-eval retries refusals; none were needed
