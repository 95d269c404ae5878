"""Push a saved kdamoe folder (weights, remote code, tokenizer, card, eval plots) to the Hugging Face Hub.

    hf auth login                                   # or set HF_TOKEN
    kdamoe-card runs/tiny/final --eval runs/tiny/eval/eval.json --repo-id your-name/kdamoe-tiny
    python -m kdamoe.hub runs/tiny/final your-name/kdamoe-tiny [--private] [--create-pr]

`push_folder` creates the repo if needed and uploads the folder in one commit through `HfApi.create_commit`.
Training leftovers (checkpoints, temp dirs, caches) are never uploaded, nor is a damaged `*.safetensors` file (the
push stops and names it). Afterwards anyone can run
`AutoModelForCausalLM.from_pretrained("your-name/kdamoe-tiny", trust_remote_code=True)`.
"""

from __future__ import annotations

import argparse
import fnmatch
from pathlib import Path

from huggingface_hub import CommitInfo, CommitOperationAdd, HfApi
from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError

from .errors import UsageError, check_safetensors, run_cli

IGNORE_PATTERNS = ("checkpoints/*", ".tmp-*", "*/.tmp-*", "__pycache__/*", "*/__pycache__/*", "*.pyc", ".git/*",
                   ".cache/*", "tensorboard/*", ".DS_Store")


def folder_operations(path: str | Path, ignore_patterns: tuple[str, ...] = IGNORE_PATTERNS
                      ) -> list[CommitOperationAdd]:
    """One `CommitOperationAdd` per file under `path` (POSIX paths relative to it), minus `ignore_patterns`;
    `UsageError` if `path` is not a saved model folder or holds a damaged safetensors file."""
    root = Path(path)
    if not (root / "config.json").is_file():
        raise UsageError(f"{root} is not a saved model folder (no config.json)")
    check_safetensors(root, "nothing was uploaded")
    operations = []
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = file.relative_to(root).as_posix()
        if not any(fnmatch.fnmatch(rel, pattern) for pattern in ignore_patterns):
            operations.append(CommitOperationAdd(path_in_repo=rel, path_or_fileobj=str(file)))
    return operations


def push_folder(path: str | Path, repo_id: str, *, api: HfApi | None = None, token: str | None = None,
                private: bool = False, revision: str | None = None, create_pr: bool = False,
                commit_message: str = "Upload kdamoe model") -> CommitInfo:
    """Create the model repo `repo_id` (if missing) and commit every file of `path` to it; returns the commit info.

    `api` defaults to `HfApi(token=token)`; tests pass a stand-in that writes commits to a local folder.
    """
    api = api or HfApi(token=token)
    operations = folder_operations(path)
    api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    return api.create_commit(repo_id, operations, commit_message=commit_message, repo_type="model",
                             revision=revision, create_pr=create_pr)


def main(argv: list[str] | None = None) -> None:
    """`kdamoe-push PATH REPO_ID` (`python -m kdamoe.hub`): push a saved folder to the Hub."""
    run_cli("kdamoe-push", _main, argv)


def _main(argv: list[str] | None) -> None:
    parser = argparse.ArgumentParser(prog="kdamoe-push", description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("repo_id")
    parser.add_argument("--private", action="store_true")
    parser.add_argument("--revision")
    parser.add_argument("--create-pr", action="store_true")
    parser.add_argument("--message", default="Upload kdamoe model")
    args = parser.parse_args(argv)
    try:
        info = push_folder(args.path, args.repo_id, private=args.private, revision=args.revision,
                           create_pr=args.create_pr, commit_message=args.message)
    except (HfHubHTTPError, LocalTokenNotFoundError) as error:  # not logged in, no access, Hub unreachable
        raise UsageError(f"pushing to {args.repo_id} failed: {error}") from error
    print(f"pushed {args.path} to {info.commit_url}")


__all__ = ["IGNORE_PATTERNS", "folder_operations", "main", "push_folder"]

if __name__ == "__main__":
    main()
