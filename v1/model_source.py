"""Where a model comes from: a local folder or a Hugging Face hub id. `check_model_source` fails
fast, in one line, when neither can work: a path that does not exist, a hub repo that does not
exist, or a hub that cannot be reached for a model that is not in the local cache (instead of
huggingface_hub's repo-id syntax error or half a minute of retries).
"""

from __future__ import annotations

from pathlib import Path

PROBE_TIMEOUT_S = 5.0
"""How long the one look at the hub may take."""


def check_model_source(name: str, *, revision: str | None = None, what: str = "model") -> None:
    """Returns when `name` is a local folder, a cached hub repo or a reachable hub repo;
    ValueError otherwise. `what` names the thing in messages ("model", "tokenizer")."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    path = Path(name).expanduser()
    if path.is_dir():
        return
    if path.exists():
        raise ValueError(f"{what} {name!r} is a file, not a folder: give the model's folder")
    try:
        validate_repo_id(name)
    except HFValidationError:
        raise ValueError(f"no such {what} folder: {name!r}") from None
    _check_hub_repo(name, revision, what)


def _check_hub_repo(repo_id: str, revision: str | None, what: str) -> None:
    from huggingface_hub import HfApi, constants, try_to_load_from_cache
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(try_to_load_from_cache(repo_id, "config.json", revision=revision), str):
        return  # cached: the loaders fall back to it even without a network
    if constants.HF_HUB_OFFLINE:
        raise ValueError(
            f"cannot load {what} {repo_id!r}: no such local folder, not in the Hugging Face "
            "cache, and HF_HUB_OFFLINE is set"
        )
    api = HfApi()
    try:
        api.model_info(repo_id, revision=revision, timeout=PROBE_TIMEOUT_S)
    except GatedRepoError:
        raise ValueError(
            f"{what} {repo_id!r} is a gated Hugging Face repo: accept its terms on the hub and "
            "log in (`hf auth login`)"
        ) from None
    except RevisionNotFoundError:
        raise ValueError(f"{what} {repo_id!r} has no revision {revision!r} on the hub") from None
    except RepositoryNotFoundError:
        raise ValueError(
            f"no such {what} folder, and no Hugging Face hub repo {repo_id!r} (or it is private: "
            "log in with `hf auth login`)"
        ) from None
    except HfHubHTTPError:
        return  # the hub answered (e.g. a server error): the download will say more
    except Exception as e:  # noqa: BLE001 - network errors: httpx/requests types vary by version
        reason = getattr(e, "strerror", None) or str(e) or type(e).__name__
        raise ValueError(
            f"cannot load {what} {repo_id!r}: no such local folder, not in the Hugging Face "
            f"cache, and the hub ({api.endpoint}) is not reachable ({reason})"
        ) from None
