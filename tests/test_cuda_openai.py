"""Log probabilities, echo, penalties, grammars and streamed n > 1 on the GPU path: the same checks as
on the CPU (against the tiny model's logits computed here), against a decode server on CUDA whose
decode steps replay CUDA graphs and overlap (the logits a step hands to sampling are a graph's
buffers), in float32 so that the reference's numbers hold."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.test_http_choices import (  # noqa: F401
    test_a_hang_up_cancels_every_choice,
    test_streamed_greedy_choices_are_each_the_single_answer,
    test_streamed_n_choices_are_the_unstreamed_ones,
)
from tests.test_http_fixtures import HttpServer
from tests.test_http_grammar import (  # noqa: F401
    test_json_schema_output_validates,
    test_regex_and_choice,
    test_rows_without_a_grammar_keep_their_tokens,
)
from tests.test_http_logprobs import (  # noqa: F401 (collected here, against this module's server)
    test_completion_logprobs_are_the_models,
    test_echo_scores_the_prompt_as_the_model_does,
    test_greedy_chosen_is_the_best_and_streams_match,
    test_streamed_echo_sends_the_prompt_first,
)
from tests.test_http_penalties import (  # noqa: F401
    test_logit_bias_min_tokens_and_min_p,
    test_penalties_in_one_batch_are_each_the_models,
)

pytest_plugins = ["tests.test_reliability_fixtures", "tests.test_http_fixtures"]
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def http_server(server_logs: Path) -> Iterator[HttpServer]:
    server = HttpServer(server_logs, "--preset", "tiny", "--device", "cuda:0", "--dtype", "float32",
                        "--max-batch-size", "16")
    server.start(timeout=300)
    yield server
    server.stop()
