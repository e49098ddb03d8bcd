"""An example for every operation of the API's OpenAPI schema, and a one-line summary where the
view says none, added by drf-spectacular's postprocessing hook (SPECTACULAR_SETTINGS).
In one place rather than on each view: the examples read as one worked story (a tiny causal LM
`tiny-a` deployed on node1's two GPUs), and tests/scheduling/test_api_docs.py holds every new
operation to having one."""

from __future__ import annotations

from typing import Any

from gpuportal.wire import deployment_spec
from gpuportal.wire.states import ReplicaState as S
from scheduling.api.serializers import NOT_SHOWN

GiB = 1024**3
MiB = 1024**2
REPLICA = "9c78f3f4ea824855a2624d00e48a3fa1"
REQUEST = "3f2a9d0c1b7e4e55a0c6d2b8e9f01a47"
AT = "2026-11-25T17:36:13.512Z"

MODEL = {"source": "/srv/models/tiny-a", "loader": "transformers", "dtype": "float32", "adapters": ""}


def shown_group(group: str, **given: Any) -> dict[str, Any]:
    """A settings group of the answer as a deploy that left it to the spec's defaults shows it,
    but for what is `given` (what was measured among it)."""
    shown = {s.key: s.default for s in deployment_spec.in_group(group) if s.name not in NOT_SHOWN}
    return {**shown, **given}


REPLICA_SHOWN = {
    "id": REPLICA,
    "deployment": "tiny-a",
    "node": "node1",
    "role": "primary",
    "state": S.SERVING,
    "gpus": [0],
    "gpu_indexes": [0],
    "gpu_ids": [1],
    "gpu_mem_bytes_by_id": {"0": 300 * MiB},
    "gpu_memory_fraction": 0.0122,
    "pid": 4242,
    "serving_since": AT,
    "last_accessed": AT,
    "epoch": 0,
    "failover_state": None,
    "kv": {
        "block_tokens": 16,
        "blocks_total": 128,
        "blocks_used": 3,
        "blocks_peak": 9,
        "allocations": 41,
        "frees": 38,
        "utilisation": 0.023,
        "blocks_cached": 24,
        "prefix_queried": 5120,
        "prefix_hits": 3968,
    },
    "failure_reason": "",
    "progress": 100,
    "arena_kept_bytes": 0,
    "host_bytes": 702545920,
    "host_copy_bytes": 0,
}
DEPLOYMENT_SHOWN = {
    "name": "tiny-a",
    "status": "ok",
    "failed_reason": "",
    "load_failures": 0,
    "retry_at": None,
    "rollout": None,
    "model": MODEL,
    "replicas": [REPLICA_SHOWN],
    "replicas_wanted": 1,
    "dedicated": False,
    "memory": shown_group(
        "memory", max_tokens=512, estimate_bytes=300 * MiB, measured_bytes=300 * MiB, need_bytes=300 * MiB
    ),
    "fairness": shown_group("fairness"),
    "sleep": shown_group("sleep"),
    "restart": shown_group("restart"),
    "failover": shown_group("failover"),
    "placement": shown_group("placement"),
    "autoscale": shown_group("autoscale", load=None),
    "created_at": AT,
    "updated_at": AT,
}
# A deployment deployed, then its idle timeout changed: revision 2 is the current.
_FIRST = {s.path: s.default for s in deployment_spec.SETTINGS if s.stored}
_FIRST.update({"model.source": MODEL["source"], "memory.max_tokens": 512})
REVISIONS = [
    {
        "revision": 2,
        "current": True,
        "at": AT,
        "by": "admin",
        "cause": "settings changed",
        "changes": {"sleep.idle_timeout_s": {"before": 300.0, "after": 60.0}},
        "settings": {**_FIRST, "sleep.idle_timeout_s": 60.0},
    },
    {
        "revision": 1,
        "current": False,
        "at": AT,
        "by": "admin",
        "cause": "deployed",
        "changes": None,
        "settings": _FIRST,
    },
]
NODE_SHOWN = {
    "name": "node1",
    "queue": "node.node1",
    "hostname": "gpu-host-1",
    "status": "online",
    "last_heartbeat": AT,
    "heartbeat_age_s": 1.2,
    "cpu_cache_bytes": 64 * GiB,
    "virtual": False,
    "labels": {
        "nvidia.com/gpu.count": "2",
        "nvidia.com/gpu.memory": "81559",
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
        "zone": "b",
    },
    "taints": {"team": "research"},
    "operator_labels": {"zone": "b"},
    "operator_taints": {"team": "research"},
    "gpu_count": 2,
    "registered_at": AT,
}
GPU_SHOWN = {
    "id": 1,
    "node": "node1",
    "index": 0,
    "uuid": "GPU-5b1c2d3e-0000-4000-8000-000000000001",
    "product": "NVIDIA H100 80GB HBM3",
    "virtual": False,
    "total_bytes": 24 * GiB,
    "available_bytes": 24 * GiB - 300 * MiB,
    "foreign_bytes": 0,
    "spare_bytes": 0,
    "reserved_bytes": 300 * MiB,
    "nvml_total_bytes": 24 * GiB + 512 * MiB,
    "context_bytes": 512 * MiB,
    "standby_context_bytes": 0,
    "nvml_free_bytes": 23 * GiB,
    "overcommit_bytes": 0,
    "version": 7,
    "health": "ok",
    "occupants": [{"replica": REPLICA, "deployment": "tiny-a", "state": S.SERVING, "reserved_bytes": 300 * MiB}],
    "intents": [],
    "wake_lock": None,
    "updated_at": AT,
}
EVENT_SHOWN = {
    "id": 42,
    "time": AT,
    "kind": "replica.state",
    "subject": f"replica {REPLICA[:8]}",
    "reason": "placed: placed new replica 9c78f3f4 of tiny-a on gpu node1/0 (300.0 MiB of 24.0 GiB); FREE, best fit",
    "before": {"state": S.PENDING},
    "after": {"state": S.SERVING},
    "node": "node1",
    "gpu": "node1/0",
    "deployment": "tiny-a",
    "replica": REPLICA,
}
REQUEST_SHOWN = {
    "id": REQUEST,
    "deployment": "tiny-a",
    "kind": "generate",
    "status": "done",
    "replica": REPLICA,
    "attempts": 1,
    "output": {"text": " world", "finish_reason": "length", "usage": {"prompt_tokens": 2, "completion_tokens": 2}},
    "error": "",
    "created_at": AT,
    "dispatched_at": AT,
    "started_at": AT,
    "first_token_at": AT,
    "finished_at": AT,
    "progress": {"phase": "done", "percent": None, "queue_position": None, "estimate_s": None},
}
WAITING_REQUEST = {
    **REQUEST_SHOWN,
    "status": "waking",
    "replica": "",
    "attempts": 0,
    "output": None,
    "dispatched_at": None,
    "started_at": None,
    "first_token_at": None,
    "finished_at": None,
    "progress": {"phase": "loading", "percent": 40, "queue_position": 1, "estimate_s": 6.0},
}


PLAN_RUNNING = {
    "id": 7,
    "state": "running",
    "percent": 40,
    "error": "",
    "skipped_rows": [],
    "result": None,
    "table": "",
    "plot_png": None,
    "elapsed_s": None,
    "created_at": AT,
    "finished_at": None,
}
PLAN_DONE = {
    **PLAN_RUNNING,
    "state": "done",
    "percent": 100,
    "result": {
        "requests": 4753,
        "deployments": 64,
        "current_gpus": 64,
        "target": 0.99,
        "slo_ttft_s": 5.0,
        "window": 3,
        "policies": [
            {"policy": "gpuportal", "fewest_gpus": 14, "holds_from": 16, "short_after": [15], "attainment_now": 0.9989},
            {"policy": "gpuportal-next", "fewest_gpus": 13, "holds_from": 13, "attainment_now": 0.9993},
            {"policy": "oracle", "fewest_gpus": 9, "holds_from": 9, "attainment_now": 1.0},
        ],
        "bound": {"oracle_gpus": 9, "load_aware_gpus": 11, "packed_gpus": 11, "held": ["m29-70b"]},
        "misses_now": [{"deployment": "m39-70b", "requests": 42, "missed": 5, "why": "wakes: mean wait 7.1 s"}],
        "advice": {
            "popular": ["m29-70b"],
            "policy": "gpuportal-next",
            "fewest_gpus": 12,
            "holds_from": 12,
            "fewest_gpus_without": 13,
            "helps": True,
            "text": "mark m29-70b popular (never preempted, as the bound holds them): gpuportal-next then needs "
            "12 GPUs instead of 13",
        },
        "scale_advice": {
            "replicas": {"m03-8b": {"replicas": 3, "autoscale": None, "command": "gpuportal set m03-8b replicas=3"}},
            "policy": "gpuportal-next",
            "fewest_gpus": 12,
            "holds_from": 12,
            "fewest_gpus_without": 13,
            "helps": True,
            "text": "give what queues behind a busy replica the replicas its load wants "
            "(gpuportal set m03-8b replicas=3): gpuportal-next then needs 12 GPUs instead of 13",
        },
    },
    "table": "| policy | fewest GPUs | holds from | attainment now |\n|---|---|---|---|\n"
    "| gpuportal-next | 13 | 13 | 99.93 % |",
    "plot_png": "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg==",
    "elapsed_s": 3.5,
    "finished_at": AT,
}


PULL = "5d0c8a1e9f2b4c7d8e6f1a2b3c4d5e6f"
PULLING = {
    "id": PULL,
    "model": "Qwen/Qwen2.5-0.5B-Instruct",
    "revision": None,
    "state": "downloading",
    "nodes": {
        "gpu-host-1": {
            "state": "downloading",
            "percent": 41,
            "done_bytes": 406847488,
            "total_bytes": 988097824,
            "files": 0,
            "path": "",
            "error": "",
        },
        "gpu-host-2": {
            "state": "done",
            "percent": 100,
            "done_bytes": 988097824,
            "total_bytes": 988097824,
            "files": 10,
            "path": "/home/gpuportal/.cache/huggingface/hub/models--Qwen--Qwen2.5-0.5B-Instruct/snapshots/7ae557604adf",
            "error": "",
        },
    },
    "url": f"/api/models/pulls/{PULL}/",
}


def page(*results: dict[str, Any]) -> dict[str, Any]:
    return {"count": len(results), "next": None, "previous": None, "results": list(results)}


COMPLETION = {
    "id": f"cmpl-{REQUEST}",
    "object": "text_completion",
    "created": 1795628173,
    "model": "tiny-a",
    "choices": [{"index": 0, "finish_reason": "length", "text": " world, and"}],
    "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5},
}

# (method, path) → summary where the view has none, the request's example, the answer's example.
# A path parameter's example stands in where an operation has neither body nor answer (a 204).
# A response cut by its max_output_tokens, as /v1/responses gives one (scheduling.api.responses).
RESPONSE = {
    "id": f"resp_{REQUEST}",
    "object": "response",
    "created_at": 1795628173,
    "status": "incomplete",
    "model": "tiny-a",
    "output": [
        {
            "type": "message",
            "id": f"msg_{REQUEST.replace('-', '')}",
            "status": "incomplete",
            "role": "assistant",
            "content": [{"type": "output_text", "text": " world, and", "annotations": [], "logprobs": []}],
        }
    ],
    "usage": {
        "input_tokens": 5,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 8,
    },
    "error": None,
    "incomplete_details": {"reason": "max_output_tokens"},
    "instructions": "Be brief.",
    "previous_response_id": None,
    "max_output_tokens": 3,
    "temperature": 0.0,
    "top_p": 1.0,
    "tools": [],
    "tool_choice": "auto",
    "parallel_tool_calls": True,
    "text": {"format": {"type": "text"}},
    "store": True,
    "truncation": "disabled",
    "background": False,
    "metadata": {},
}

EXAMPLES: dict[tuple[str, str], dict[str, Any]] = {
    ("post", "/api/auth/token/"): {
        "request": {"username": "admin", "password": "the password in var/admin-password"},
        "response": {"token": "9944b09199c62bcf9418ad846dd0e4bbdfc6ee4b"},
    },
    ("get", "/api/nodes/"): {"response": page(NODE_SHOWN)},
    ("get", "/api/nodes/{name}/"): {"response": NODE_SHOWN},
    ("patch", "/api/nodes/{name}/"): {
        "request": {"labels": {"zone": "b"}, "taints": {"team": "research"}},
        "response": NODE_SHOWN,
    },
    ("delete", "/api/nodes/{name}/"): {"parameter": "node1"},
    ("post", "/api/nodes/{name}/move-misplaced/"): {"response": {"moving": {"chat": 2}, "staying": {}}},
    ("post", "/api/nodes/{name}/drain/"): {"request": {"move": True}, "response": {**NODE_SHOWN, "status": "draining"}},
    ("post", "/api/nodes/{name}/undrain/"): {"response": NODE_SHOWN},
    ("post", "/api/nodes/{name}/credential/"): {
        "response": {"node": "node1", "token": "gpn_Xq3v0mJc2kU9yR1tB8dLwA4sHfN6pE7gZo5iYbTcVuQ"}
    },
    ("delete", "/api/nodes/{name}/credential/"): {
        "response": {
            "node": "node1",
            "created_at": AT,
            "created_by": "admin",
            "revoked_at": AT,
            "last_used_at": AT,
        }
    },
    ("get", "/api/gpus/"): {
        "summary": "List GPUs: memory, occupants, waiting intents and the wake lock of each",
        "response": page(GPU_SHOWN),
    },
    ("get", "/api/gpus/{id}/"): {
        "summary": "One GPU: its books (total, reserved, available) beside what NVML reads",
        "response": GPU_SHOWN,
    },
    ("get", "/api/deployments/"): {"response": page(DEPLOYMENT_SHOWN)},
    ("post", "/api/deployments/"): {
        "request": {"name": "tiny-a", "model": MODEL, "replicas": 1, "memory": {"max_tokens": 512}},
        "response": {**DEPLOYMENT_SHOWN, "warnings": []},
    },
    ("get", "/api/deployments/{name}/"): {"response": DEPLOYMENT_SHOWN},
    ("patch", "/api/deployments/{name}/"): {
        "request": {"fairness": {"max_wait_s": 2.0}, "sleep": {"idle_timeout_s": 60}},
        "response": {**DEPLOYMENT_SHOWN, "warnings": []},
    },
    ("delete", "/api/deployments/{name}/"): {"parameter": "tiny-a"},
    ("post", "/api/deployments/{name}/scale/"): {
        "request": {"replicas": 3},
        "response": {**DEPLOYMENT_SHOWN, "replicas_wanted": 3},
    },
    ("get", "/api/deployments/{name}/revisions/"): {"response": REVISIONS},
    ("post", "/api/deployments/{name}/rollback/"): {
        "request": {"revision": 1},
        "response": {
            **DEPLOYMENT_SHOWN,
            "warnings": [],
            "rollback": {"to": 1, "revision": 3, "changes": {"sleep.idle_timeout_s": {"before": 60.0, "after": 300.0}}},
        },
    },
    ("post", "/api/deployments/{name}/evict/"): {"response": DEPLOYMENT_SHOWN},
    ("post", "/api/deployments/{name}/failover/"): {"response": DEPLOYMENT_SHOWN},
    ("post", "/api/deployments/{name}/retry/"): {"response": DEPLOYMENT_SHOWN},
    ("post", "/api/deployments/{name}/restart/"): {
        # Its first step taken: a surge placed beside the one replica, the deployment still wanting one.
        "response": {
            **DEPLOYMENT_SHOWN,
            "rollout": {"since": AT, "replaced": 1, "left": 1, "move": False},
            "replicas": [
                REPLICA_SHOWN,
                {**REPLICA_SHOWN, "id": "9e1b7c2d4f6a48b0a3c5d7e9f1a2b3c4", "state": S.PENDING, "progress": None},
            ],
        }
    },
    ("post", "/api/deployments/{name}/sleep/"): {"response": DEPLOYMENT_SHOWN},
    ("post", "/api/deployments/{name}/deep-sleep/"): {"response": DEPLOYMENT_SHOWN},
    ("post", "/api/deployments/{name}/wake/"): {"response": DEPLOYMENT_SHOWN},
    ("post", "/api/deployments/{name}/infer/"): {
        "request": {"input": "Hello", "params": {"max_tokens": 2}, "timeout_s": 30},
        "response": REQUEST_SHOWN,
    },
    ("get", "/api/replicas/"): {"response": page(REPLICA_SHOWN)},
    ("get", "/api/replicas/{id}/"): {"response": REPLICA_SHOWN},
    ("post", "/api/replicas/{id}/evict/"): {"response": {**REPLICA_SHOWN, "state": S.DRAINING}},
    ("post", "/api/replicas/{id}/sleep/"): {"response": {**REPLICA_SHOWN, "state": S.DRAINING}},
    ("post", "/api/replicas/{id}/deep-sleep/"): {"response": {**REPLICA_SHOWN, "state": S.SLEEPING}},
    ("post", "/api/replicas/{id}/wake/"): {"response": {**REPLICA_SHOWN, "state": S.WAKING}},
    ("get", "/api/replicas/{id}/logs/"): {
        "response": {
            "replica": REPLICA,
            "node": "node1",
            "path": f"/srv/gpuportal/var/replicas/node1/replica-{REPLICA}.log",
            "lines": ["2026-11-25 17:36:13,512 INFO inference.replica: loaded 10.0 MiB of weights; serving"],
            "missing": False,
        }
    },
    ("get", "/api/events/"): {"response": page(EVENT_SHOWN)},
    ("get", "/api/events/{id}/"): {"response": EVENT_SHOWN},
    ("get", "/api/traffic/"): {
        "response": {
            "results": [
                {
                    "deployment": "tiny-a",
                    "window_s": 300.0,
                    "ended": 42,
                    "done": 41,
                    "failed": 1,
                    "cancelled": 0,
                    "latency_s": {"p50": 0.84, "p95": 2.1, "p99": 6.3},
                    "ttft_s": {"p50": 0.12, "p95": 0.4, "p99": 4.9},
                    "queue_s": {"p50": 0.01, "p95": 0.2, "p99": 4.7},
                    "per_output_token_s": {"p50": 0.021, "p95": 0.03, "p99": 0.05},
                    "output_tokens": 1312,
                    "output_tokens_per_s": 4.37,
                }
            ]
        }
    },
    ("get", "/api/requests/"): {"response": {"next": None, "previous": None, "results": [REQUEST_SHOWN]}},
    ("post", "/api/requests/"): {
        "summary": "Submit a request and get its id at once (202); poll it, or list it",
        "request": {"deployment": "tiny-a", "input": "Hello"},
        "response": WAITING_REQUEST,
    },
    ("get", "/api/requests/{id}/"): {
        "summary": "One request: its status, its output once done, and while it waits, its progress",
        "response": WAITING_REQUEST,
    },
    ("delete", "/api/requests/{id}/"): {
        "summary": "Cancel a request no replica has taken yet (409 once one has)",
        "response": {**WAITING_REQUEST, "status": "cancelled", "error": "cancelled by its owner"},
    },
    ("post", "/api/plan/"): {
        "request": {
            "trace": "arrival,deployment,prompt_tokens,output_tokens\n2026-11-25T17:36:13Z,tiny-a,128,32\n",
            "target": 0.99,
            "slo_ttft_s": 5.0,
        },
        "response": {**PLAN_RUNNING, "state": "queued", "percent": 0},
    },
    ("get", "/api/plan/{id}/"): {"response": PLAN_DONE},
    ("post", "/api/models/pull/"): {
        "request": {"model": "Qwen/Qwen2.5-0.5B-Instruct"},
        "response": {
            **PULLING,
            "state": "queued",
            "nodes": {
                node: {
                    **said,
                    "state": "queued",
                    "percent": 0,
                    "done_bytes": 0,
                    "total_bytes": 0,
                    "files": 0,
                    "path": "",
                }
                for node, said in PULLING["nodes"].items()
            },
        },
    },
    ("get", "/api/models/pulls/{id}/"): {"response": PULLING},
    ("get", "/v1/models"): {
        "summary": "The deployments, as OpenAI's model list (a model is a deployment's name)",
        "response": {
            "object": "list",
            "data": [{"id": "tiny-a", "object": "model", "created": 1795628173, "owned_by": "gpuportal"}],
        },
    },
    ("get", "/v1/models/{model}"): {
        "summary": "One model, as OpenAI's retrieve model (a 404 in OpenAI's shape names the nearest)",
        "response": {"id": "tiny-a", "object": "model", "created": 1795628173, "owned_by": "gpuportal"},
    },
    ("post", "/v1/completions"): {
        "request": {"model": "tiny-a", "prompt": "Hello", "max_tokens": 3},
        "response": COMPLETION,
    },
    ("post", "/v1/chat/completions"): {
        "request": {"model": "tiny-a", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3},
        "response": {
            **COMPLETION,
            "id": f"chatcmpl-{REQUEST}",
            "object": "chat.completion",
            "choices": [
                {"index": 0, "finish_reason": "length", "message": {"role": "assistant", "content": " world, and"}}
            ],
        },
    },
    ("post", "/v1/responses"): {
        "request": {"model": "tiny-a", "instructions": "Be brief.", "input": "Hello", "max_output_tokens": 3},
        "response": RESPONSE,
    },
    ("post", "/v1/messages"): {
        "request": {
            "model": "tiny-a",
            "max_tokens": 1024,
            "system": "Be brief.",
            "messages": [{"role": "user", "content": "Hello"}],
        },
        "response": {
            "id": f"msg_{REQUEST.replace('-', '')}",
            "type": "message",
            "role": "assistant",
            "model": "tiny-a",
            "content": [{"type": "text", "text": "Hello! How can I help?"}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": {
                "input_tokens": 12,
                "output_tokens": 8,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
            },
        },
    },
    ("post", "/v1/messages/count_tokens"): {
        "request": {"model": "tiny-a", "system": "Be brief.", "messages": [{"role": "user", "content": "Hello"}]},
        "response": {"input_tokens": 12},
    },
    ("post", "/tokenize"): {
        "request": {"model": "tiny-a", "prompt": "Hello world"},
        "response": {"count": 3, "max_model_len": 2048, "tokens": [1, 15043, 3186]},
    },
    ("post", "/detokenize"): {
        "request": {"model": "tiny-a", "tokens": [1, 15043, 3186]},
        "response": {"prompt": "<s> Hello world"},
    },
    ("post", "/api/chat"): {
        "request": {"model": "tiny-a", "messages": [{"role": "user", "content": "Hello"}], "stream": False},
        "response": {
            "model": "tiny-a",
            "created_at": "2026-12-03T06:40:12.123456Z",
            "message": {"role": "assistant", "content": "Hello! How can I help?"},
            "done": True,
            "done_reason": "stop",
            "total_duration": 210000000,
            "load_duration": 1000000,
            "prompt_eval_count": 12,
            "prompt_eval_duration": 20000000,
            "eval_count": 8,
            "eval_duration": 189000000,
        },
    },
    ("post", "/api/generate"): {
        "request": {"model": "tiny-a", "prompt": "Hello", "stream": False},
        "response": {
            "model": "tiny-a",
            "created_at": "2026-12-03T06:40:12.123456Z",
            "response": "Hello! How can I help?",
            "done": True,
            "done_reason": "stop",
            "eval_count": 8,
        },
    },
    ("post", "/v1/load_lora_adapter"): {
        "request": {"lora_name": "tiny-a:sql", "lora_path": "/srv/adapters/sql"},
        "response": "Success: LoRA adapter 'tiny-a:sql' added; deployment tiny-a's replicas roll onto it.",
    },
    ("post", "/v1/unload_lora_adapter"): {
        "request": {"lora_name": "tiny-a:sql"},
        "response": "Success: LoRA adapter 'tiny-a:sql' removed; deployment tiny-a's replicas roll off it.",
    },
    ("post", "/api/embed"): {
        "request": {"model": "minilm", "input": ["A cat sits.", "A dog runs."]},
        "response": {"model": "minilm", "embeddings": [[0.0213, -0.0841, 0.0377]], "prompt_eval_count": 8},
    },
    ("get", "/api/tags"): {
        "response": {
            "models": [
                {
                    "name": "tiny-a",
                    "model": "tiny-a",
                    "modified_at": "2026-12-03T06:40:12+00:00",
                    "size": 734003200,
                    "digest": "",
                    "details": {"format": "safetensors", "family": "transformers", "quantization_level": "float32"},
                }
            ]
        }
    },
    ("get", "/api/ps"): {
        "response": {
            "models": [
                {"name": "tiny-a", "model": "tiny-a", "size": 734003200, "size_vram": 734003200, "context_length": 2048}
            ]
        }
    },
    ("post", "/api/show"): {
        "request": {"model": "tiny-a"},
        "response": {
            "model_info": {"general.architecture": "gpuportal", "gpuportal.context_length": 2048},
            "capabilities": ["completion", "tools", "thinking"],
        },
    },
    ("get", "/api/version"): {"response": {"version": "0.1.0"}},
    ("get", "/v1/responses/{response_id}"): {
        "summary": "A response of yours as it stands, as OpenAI's retrieve response (kept for a day)",
        "parameter": f"resp_{REQUEST}",
        "response": RESPONSE,
    },
    ("delete", "/v1/responses/{response_id}"): {
        "summary": "Delete a response of yours that has ended, with what it was asked and answered",
        "parameter": f"resp_{REQUEST}",
        "response": {"id": f"resp_{REQUEST}", "object": "response.deleted", "deleted": True},
    },
    ("post", "/v1/responses/{response_id}/cancel"): {
        "summary": "Cancel a response of yours: where it waits at once, where it runs stopped where it is",
        "parameter": f"resp_{REQUEST}",
        "response": {
            **RESPONSE,
            "status": "cancelled",
            "output": [],
            "usage": None,
            "incomplete_details": None,
            "background": True,
            "error": {"code": "cancelled", "message": f"request {REQUEST} was cancelled by its owner"},
        },
    },
    ("get", "/v1/responses/{response_id}/input_items"): {
        "parameter": f"resp_{REQUEST}",
        "response": {
            "object": "list",
            "data": [
                {
                    "type": "message",
                    "id": f"msg_{REQUEST.replace('-', '')}_0",
                    "role": "user",
                    "status": "completed",
                    "content": [{"type": "input_text", "text": "Hello"}],
                }
            ],
            "first_id": f"msg_{REQUEST.replace('-', '')}_0",
            "last_id": f"msg_{REQUEST.replace('-', '')}_0",
            "has_more": False,
        },
    },
    ("post", "/v1/embeddings"): {
        "request": {"model": "minilm", "input": ["A cat sits.", "A dog runs."]},
        "response": {
            "object": "list",
            "data": [{"object": "embedding", "index": 0, "embedding": [0.0213, -0.0841, 0.0377]}],
            "model": "minilm",
            "usage": {"prompt_tokens": 8, "total_tokens": 8},
        },
    },
    ("post", "/api/embeddings"): {
        "request": {"model": "minilm", "prompt": "A cat sits."},
        "response": {"embedding": [0.0213, -0.0841, 0.0377]},
    },
    **{
        ("post", path): {
            "request": {
                "model": "minilm",
                "query": "Where do cats sleep?",
                "documents": ["Stocks fell today.", "Cats sleep in the sun."],
                "top_n": 1,
            },
            "response": {
                "id": f"rerank-{REQUEST}",
                "model": "minilm",
                "results": [{"index": 1, "relevance_score": 0.6718, "document": {"text": "Cats sleep in the sun."}}],
                "usage": {"prompt_tokens": 18, "total_tokens": 18},
            },
        }
        for path in ("/v1/rerank", "/rerank", "/v2/rerank")
    },
    **{
        ("post", path): {
            "request": {"model": "minilm", "text_1": "Where do cats sleep?", "text_2": ["Cats sleep in the sun."]},
            "response": {
                "id": f"score-{REQUEST}",
                "object": "list",
                "created": 1795628173,
                "model": "minilm",
                "data": [{"index": 0, "object": "score", "score": 0.6718}],
                "usage": {"prompt_tokens": 14, "total_tokens": 14},
            },
        }
        for path in ("/v1/score", "/score")
    },
}


def add_examples(result: dict[str, Any], generator: Any, request: Any, public: bool) -> dict[str, Any]:
    """drf-spectacular postprocessing hook: the examples above into the generated schema."""
    for path, operations in result.get("paths", {}).items():
        for method, operation in operations.items():
            known = EXAMPLES.get((method, path))
            if known is None:
                continue
            if "summary" in known and not (operation.get("summary") or operation.get("description")):
                operation["summary"] = known["summary"]
            if "request" in known:
                for content in operation.get("requestBody", {}).get("content", {}).values():
                    content["examples"] = {"example": {"value": known["request"]}}
            if "response" in known:
                for code, answer in operation.get("responses", {}).items():
                    if code.startswith("2") and "application/json" in answer.get("content", {}):
                        answer["content"]["application/json"]["examples"] = {"example": {"value": known["response"]}}
                        break
            if "parameter" in known:
                for parameter in operation.get("parameters", []):
                    if parameter.get("in") == "path":
                        parameter["example"] = known["parameter"]
    return result
