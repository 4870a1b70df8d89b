"""`stalwart serve --hf` spoken to by clients nobody here wrote: lm-evaluation-harness's
`local-completions` backend scores a local JSONL task through the server (echo + logprobs on token-id
prompts), and its per-example log-likelihoods equal its own `hf` backend's on the same exported model
within 1e-4; `transformers` renders the chat template the exported directory ships, and the server's
chat reply is the completion of exactly that text; OpenAI's client sends content parts and several
choices. One trained run, one export and one server for every case."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_cli, tiny_hf
from test_serve_e2e import Server

import lm_eval  # noqa: F401 - a missing lm-eval fails here (it is in the test extra), not a skip

pytestmark = pytest.mark.e2e

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
DOCS = [("def main():\n", "    return 0"), ("import json\n", "import os"), ("class Foo(object):\n", "    pass"),
        ("for i in range(10):\n", "    print(i)"), ("x = [1, 2, 3]\n", "y = x[0]")]
TASK = """task: stalwart_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval")
    hf = tiny_hf(root, 2)
    config = json.loads((hf / "tokenizer_config.json").read_text())
    (hf / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    server = Server(root, "--hf", str(hf))
    yield server, hf, root
    server.stop()


def test_lm_eval_log_likelihoods_through_the_server_equal_its_hf_backend(served, monkeypatch):
    server, hf, root = served
    for name, value in (("HF_DATASETS_OFFLINE", "1"), ("HF_HUB_OFFLINE", "1"), ("HF_HOME", str(root / "hf-home"))):
        monkeypatch.setenv(name, value)
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    # One example continues its context the way the model would (greedy): is_greedy must agree on it too.
    greedy = server.client.completions.create(model="hf", prompt="while True:\n", max_tokens=3, temperature=0,
                                              extra_body={"ignore_eos": True}).choices[0].text
    task = root / "task"
    task.mkdir()
    with open(task / "data.jsonl", "w") as f:
        for context, continuation in [*DOCS, ("while True:\n", greedy)]:
            f.write(json.dumps({"context": context, "continuation": continuation}) + "\n")
    (task / "stalwart_local.yaml").write_text(TASK.format(data=task / "data.jsonl"))
    tasks = TaskManager(include_path=str(task))

    def scores(model: str, args: dict, **kw) -> dict[int, tuple[float, bool]]:
        out = simple_evaluate(model=model, model_args=args, tasks=["stalwart_local"], task_manager=tasks,
                              log_samples=True, bootstrap_iters=0, **kw)
        return {s["doc_id"]: (float(s["filtered_resps"][0][0]), bool(s["filtered_resps"][0][1]))
                for s in out["samples"]["stalwart_local"]}

    # batch_size 4: several token-id prompts per request.
    api = scores("local-completions", {"base_url": server.url + "/v1/completions", "model": "hf",
                                       "tokenizer_backend": "huggingface", "tokenizer": str(hf), "batch_size": 4,
                                       "num_concurrent": 1, "max_retries": 1, "max_length": 128})
    ref = scores("hf", {"pretrained": str(hf), "dtype": "float32", "device": "cpu"}, batch_size=2)
    assert sorted(api) == sorted(ref) == list(range(len(DOCS) + 1))
    for doc in ref:
        assert abs(api[doc][0] - ref[doc][0]) < 1e-4, (doc, api[doc], ref[doc])
        assert api[doc][1] == ref[doc][1], doc


def test_chat_renders_the_directorys_template_as_transformers_does(served):
    from transformers import AutoTokenizer

    server, hf, _ = served
    c = server.client
    messages = [{"role": "system", "content": "Answer in code."}, {"role": "user", "content": "def f(x):"}]
    rendered = AutoTokenizer.from_pretrained(str(hf)).apply_chat_template(messages, add_generation_prompt=True,
                                                                          tokenize=False)
    bos = json.loads((hf / "tokenizer_config.json").read_text())["bos_token"]
    assert rendered.startswith(bos + "<|system|>")  # the template's bos_token: tokenizer_config.json's
    chat = c.chat.completions.create(model="hf", messages=messages, max_tokens=5, temperature=0)
    plain = c.completions.create(model="hf", prompt=rendered, max_tokens=5, temperature=0)
    assert chat.usage.prompt_tokens == plain.usage.prompt_tokens
    assert chat.choices[0].message.content == plain.choices[0].text
    # OpenAI's content-parts form (what guidellm sends) is the same conversation.
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in messages]
    again = c.chat.completions.create(model="hf", messages=parts, max_tokens=5, temperature=0)
    assert again.choices[0].message.content == chat.choices[0].message.content
    # Several seeded choices; max_completion_tokens 0 is refused by name, not taken as unset.
    two = c.chat.completions.create(model="hf", messages=parts, max_completion_tokens=4, n=2, seed=1)
    assert [x.index for x in two.choices] == [0, 1] and two.usage.completion_tokens <= 8
    with pytest.raises(Exception, match="max_completion_tokens must be >= 1") as e:
        c.chat.completions.create(model="hf", messages=parts, max_completion_tokens=0)
    assert e.value.body["param"] == "max_completion_tokens"


def test_a_template_that_does_not_parse_is_one_line_before_anything_starts(served):
    _, hf, root = served
    bad = root / "hf-bad-template"
    bad.mkdir()
    for f in hf.iterdir():
        (bad / f.name).symlink_to(f)
    (bad / "chat_template.jinja").write_text("{% if messages %}never closed")
    proc = run_cli("serve", "--hf", str(bad), "--port", "0", check=False, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"stalwart serve: error: {bad / 'chat_template.jinja'}: the chat template does not parse (Unexpected end "
        "of template."), proc.stderr
