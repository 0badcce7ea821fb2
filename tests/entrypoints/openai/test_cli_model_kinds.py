"""`v1 generate` / `v1 embed` given the wrong kind of model fail at once with one line naming
the subcommand that fits; `--scheduling-policy` is `--policy`; `v1 serve --served-model-name`
takes several aliases, all listed in /v1/models and all accepted as `model`."""

from __future__ import annotations

import openai
import pytest

from tests.entrypoints.openai.conftest import MINILM_DIR, WHISPER_DIR, RemoteServer
from tests.utils import require_asset
from v1.entrypoints.cli import engine_kwargs, main, make_parser


@pytest.mark.parametrize(
    ("command", "asset", "fits"),
    [
        (["generate", "hello"], WHISPER_DIR, "v1 transcribe --model {} FILE..."),
        (["generate", "hello"], MINILM_DIR, "v1 embed --model {} TEXT..."),
        (["embed", "hello"], WHISPER_DIR, "v1 transcribe --model {} FILE..."),
    ],
    ids=["whisper-to-generate", "embedder-to-generate", "whisper-to-embed"],
)
def test_the_wrong_kind_of_model_names_the_subcommand_that_fits(
    command: list[str], asset, fits: str, capsys: pytest.CaptureFixture[str]
) -> None:
    require_asset(asset)
    argv = [command[0], "--model", str(asset), *command[1:], "--device", "cpu"]
    assert main(argv) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"v1 {command[0]}: error: "), lines
    assert f"`{fits.format(asset)}`" in lines[0]


def test_a_generative_model_given_to_embed_names_generate(
    tiny_llama_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["embed", "--model", tiny_llama_dir, "hello", "--device", "cpu"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("v1 embed: error: ") and "v1 generate --model" in line


def test_scheduling_policy_flag_is_the_policy_engine_argument() -> None:
    args = make_parser().parse_args(["serve", "m", "--scheduling-policy", "priority"])
    assert engine_kwargs(args) == {"policy": "priority"}
    args = make_parser().parse_args(["serve", "m", "--policy", "fcfs"])
    assert engine_kwargs(args) == {"policy": "fcfs"}
    with pytest.raises(SystemExit):
        make_parser().parse_args(["serve", "m", "--scheduling-policy", "lifo"])


def test_every_served_model_alias_is_listed_and_accepted(llama_server: RemoteServer) -> None:
    client = llama_server.openai()
    names = [m.id for m in client.models.list().data]
    assert names == ["tiny-llama", "tiny-llama-alias"]
    texts = set()
    for name in names:
        out = client.completions.create(model=name, prompt="the quick", max_tokens=4, temperature=0)
        assert out.model == "tiny-llama"  # the first name, as vLLM answers
        texts.add(out.choices[0].text)
        chat = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert chat.choices[0].message.role == "assistant"
    assert len(texts) == 1  # one model behind both names
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="whisper-1", prompt="x", max_tokens=1)
