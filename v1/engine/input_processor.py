"""Frontend edge: a user prompt + params -> validated EngineCoreRequests.

Checks the params once and hands the prompt to the input builder of the model's kind
(`v1.engine.inputs`, chosen once): nothing invalid reaches the core. n > 1 becomes n children.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from v1.config import LoRAConfig, ModelConfig
from v1.core.protocol import EngineCoreRequest, now
from v1.engine.inputs import make_input_builder
from v1.lora_request import LoRARequest
from v1.pooling_params import PoolingParams
from v1.sampling_params import SamplingParams

if TYPE_CHECKING:
    from v1.model_info import ModelInfo

Params = SamplingParams | PoolingParams


class InputProcessor:
    """Turns prompts into EngineCoreRequests for one model (see DESIGN.md section 2 and the
    builders in `v1.engine.inputs` for each kind's prompt forms)."""

    def __init__(
        self,
        model_config: ModelConfig,
        tokenizer: Any,
        *,
        max_num_batched_tokens: int | None = None,
        model_info: ModelInfo | None = None,
        lora_config: LoRAConfig | None = None,
        audio_hash_in_core: bool = False,
    ) -> None:
        """`model_info`: the process's ModelInfo (default: `model_config.info`).
        `audio_hash_in_core`: Whisper audio goes to the cores unhashed (they hash it; see
        `InputBuilder.audio_hash_in_core`): for data-parallel engines."""
        self.model_config = model_config
        self.lora_config = lora_config if lora_config is not None else LoRAConfig()
        self._lora_targets: Any = None
        """The model's LoRA view (built on the meta device on the first adapter)."""
        self._checked_loras: dict[int, LoRARequest] = {}
        """Adapters read and checked once, by id."""
        self.tokenizer = tokenizer
        self.info = model_info if model_info is not None else model_config.info
        self.builder = make_input_builder(
            self.info, tokenizer, max_num_batched_tokens=max_num_batched_tokens
        )
        self.builder.audio_hash_in_core = audio_hash_in_core

    # ---- public ----
    def check_lora(self, lora_request: Any) -> None:
        """ValueError unless `lora_request` is None or an adapter this engine can serve: LoRA
        on, a readable PEFT folder of rank <= max_lora_rank whose targets and shapes fit the
        model. Each adapter id is read once (later requests naming it are only compared)."""
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(
                f"lora_request must be a LoRARequest, got {type(lora_request).__name__}"
            )
        if not self.lora_config.enable_lora:
            raise ValueError("lora_request given but LoRA is not enabled (enable_lora=True)")
        known = self._checked_loras.get(lora_request.lora_int_id)
        if known is not None:
            if known.lora_path != lora_request.lora_path:
                raise ValueError(
                    f"lora_int_id {lora_request.lora_int_id} is already adapter "
                    f"{known.lora_name!r} at {known.lora_path!r}"
                )
            return
        from v1.lora import load_adapter, lora_targets_for_config

        if self._lora_targets is None:
            mc = self.model_config
            self._lora_targets = lora_targets_for_config(mc.hf_config, mc.architecture)
        load_adapter(lora_request, self._lora_targets, self.lora_config.max_lora_rank)
        self._checked_loras[lora_request.lora_int_id] = lora_request

    def forget_lora(self, lora_int_id: int) -> None:
        """An unloaded adapter: the next request naming the id reads its folder again."""
        self._checked_loras.pop(lora_int_id, None)

    def process_all(
        self,
        request_id: str,
        prompt: Any,
        params: Any,
        *,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> list[EngineCoreRequest]:
        """The core requests one user request becomes: itself, or its n children for n > 1
        sampling (ids and seeds from ParentRequest). Raises ValueError on invalid input."""
        if lora_request is not None:
            self.check_lora(lora_request)
            if not isinstance(params, SamplingParams):
                raise ValueError("lora_request applies to generation, not pooling")
            return [
                msgspec.structs.replace(r, lora_request=lora_request)
                for r in self.process_all(request_id, prompt, params, priority=priority)
            ]
        if isinstance(params, SamplingParams) and params.n > 1:
            from v1.engine.output_processor import ParentRequest

            parent = ParentRequest(request_id, params)
            ids = parent.child_ids
            first = self.process(ids[0], prompt, parent.child_params(0), priority=priority)
            children = [first] + [
                self.builder.build_child(
                    first, prompt, ids[i], parent.child_params(i), priority=priority
                )
                for i in range(1, params.n)
            ]
            for child in children:  # the children share their parent's fair share
                child.group_id = request_id
            return children
        return [self.process(request_id, prompt, params, priority=priority)]

    def process(
        self,
        request_id: str,
        prompt: Any,
        params: Params,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> EngineCoreRequest:
        """Validates and tokenizes one prompt; raises ValueError on anything the core would
        reject or the model cannot serve."""
        self.builder.check_params(params)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an int, got {priority!r}")
        arrival_time = now() if arrival_time is None else arrival_time
        return self.builder.build(
            request_id, prompt, params, arrival_time=arrival_time, priority=priority
        )

    def process_pair(
        self,
        request_id: str,
        text_a: str,
        text_b: str,
        pooling_params: PoolingParams,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> EngineCoreRequest:
        """A text pair for a cross-encoder, tokenized as one input with segment ids."""
        return self.process(
            request_id,
            {"text": text_a, "text_pair": text_b},
            pooling_params,
            arrival_time=arrival_time,
            priority=priority,
        )

    @property
    def whisper_builder(self) -> Any:
        """The Whisper input builder (built once with the processor; transcription reuses it)."""
        from v1.engine.inputs.whisper import WhisperInputBuilder

        if not isinstance(self.builder, WhisperInputBuilder):
            raise ValueError(f"{self.model_config.architecture} is not a Whisper model")
        return self.builder

    def prompt_texts(self, prompt: Any) -> tuple[str | None, str | None]:
        """(decoder prompt text, encoder prompt text) of a prompt, for RequestOutput."""
        return self.builder.prompt_texts(prompt)
