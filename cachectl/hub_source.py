"""``hf://org/repo[@revision]``: a model repository on a Hugging Face hub.

Resolves the revision to a commit and lists its files with their digests (LFS SHA-256, else
the git blob id) through ``HfApi``. Downloads ``workers`` files at a time from the commit's
``resolve`` URLs with huggingface_hub's ``http_get``: each file streams into
``.incomplete/<name>`` inside the pull's model folder, and a pull that finds one there (its
daemon was killed) continues it with a range request from its size, then renames it into
place. Not ``snapshot_download``: the pinned huggingface_hub (2.4) writes each file to a
process-unique temporary name, so a killed pull's bytes were never resumed (the whole model
was fetched again; bench/model_delivery.py measured it). The commit is pinned in every URL,
so a resumed file cannot mix two versions. ``$HF_ENDPOINT`` is honoured (read at pull time, so
a mirror or a test fixture works), the token comes from the request or ``$HF_TOKEN``. The
hub's errors become the cache's: 404 -> ModelNotFoundError, 401/403 and gated repos ->
ModelAccessError. Called through ``sources.source_for`` by ``pulls``.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ditserve.cachectl.errors import ModelAccessError, ModelNotFoundError, ModelSourceError
from ditserve.cachectl.model_uri import ModelUri
from ditserve.cachectl.sources import (
    CancellableWriter,
    Credentials,
    RemoteFile,
    Snapshot,
    fetch_all,
)

INCOMPLETE = ".incomplete"  # inside the model folder of a partial pull; never published
DEFAULT_ENDPOINT = "https://huggingface.co"


class HubSource:
    def __init__(self, uri: ModelUri, credentials: Credentials) -> None:
        self.uri = uri
        self.token = credentials.hf_token or None  # None: huggingface_hub reads $HF_TOKEN
        self.endpoint = (credentials.hf_endpoint or os.environ.get("HF_ENDPOINT")
                         or DEFAULT_ENDPOINT).rstrip("/")

    @contextlib.contextmanager
    def _hub_errors(self) -> Iterator[None]:
        from huggingface_hub import constants
        from huggingface_hub.errors import (
            GatedRepoError,
            HfHubHTTPError,
            OfflineModeIsEnabled,
            RemoteEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        uri = str(self.uri)
        if constants.HF_HUB_OFFLINE:
            raise ModelSourceError(uri, "HF_HUB_OFFLINE is set in this process; unset it (or "
                                        "set HF_HUB_OFFLINE=0) to download")
        try:
            yield
        except GatedRepoError as e:
            raise ModelAccessError(uri, "the repository is gated: accept its terms on the hub "
                                        "with the account whose token you pass (HF_TOKEN)") from e
        except RevisionNotFoundError as e:
            raise ModelNotFoundError(uri, f"revision {self.uri.revision!r} does not exist in "
                                          f"{self.uri.repo} on {self.endpoint}") from e
        except RepositoryNotFoundError as e:
            if _status(e) == 401:
                raise ModelAccessError(uri, f"{self.endpoint} refused access (401): the "
                                            "repository is private or does not exist; pass a "
                                            "token that may read it (HF_TOKEN)") from e
            raise ModelNotFoundError(uri, f"no repository {self.uri.repo} on {self.endpoint} "
                                          "(404)") from e
        except RemoteEntryNotFoundError as e:
            raise ModelNotFoundError(uri, f"a listed file is gone from the hub (404): {e}") from e
        except HfHubHTTPError as e:
            code = _status(e)
            if code in (401, 403):
                raise ModelAccessError(uri, f"{self.endpoint} refused the token ({code}); pass "
                                            "a token that may read the repository") from e
            raise ModelSourceError(uri, f"the hub answered {code}: {e}") from e
        except OfflineModeIsEnabled as e:
            raise ModelSourceError(uri, f"huggingface_hub is in offline mode: {e}") from e
        except _transport_errors() as e:  # refused, reset, timed out, DNS: the hub is unreachable
            raise ModelSourceError(uri, f"cannot reach {self.endpoint}: {e}") from e

    def resolve(self) -> Snapshot:
        from huggingface_hub import HfApi
        from huggingface_hub.hf_api import RepoFile

        api = HfApi(endpoint=self.endpoint, token=self.token)
        with self._hub_errors():
            info = api.model_info(self.uri.repo, revision=self.uri.revision)
            commit = info.sha
            if not commit:
                raise ModelSourceError(str(self.uri), "the hub named no commit for the revision")
            files = [_remote_file(f) for f in api.list_repo_tree(
                self.uri.repo, recursive=True, revision=commit) if isinstance(f, RepoFile)]
        identity = {"schema": 1, "source": "hf", "repo": self.uri.repo, "revision": commit}
        return Snapshot(str(self.uri), identity, commit, files)

    def download(self, snapshot: Snapshot, model_dir: Path, *, workers: int,
                 cancel: threading.Event) -> None:
        todo = [f for f in snapshot.files
                if not ((model_dir / f.name).is_file()
                        and (model_dir / f.name).stat().st_size == f.size)]
        with self._hub_errors():
            fetch_all(snapshot.uri, lambda f: self._fetch(snapshot.revision, f, model_dir, cancel),
                      todo, workers=workers, cancel=cancel, thread_name_prefix="cachectl-hub")

    def _fetch(self, commit: str, f: RemoteFile, model_dir: Path,
               cancel: threading.Event) -> None:
        from huggingface_hub import hf_hub_url
        from huggingface_hub.file_download import http_get
        from huggingface_hub.utils import build_hf_headers

        part = model_dir / INCOMPLETE / f.name
        part.parent.mkdir(parents=True, exist_ok=True)
        have = part.stat().st_size if part.exists() else 0
        if have > f.size:  # not a prefix of this file: start over
            part.unlink()
            have = 0
        if have < f.size:
            url = hf_hub_url(self.uri.repo, f.name, revision=commit, endpoint=self.endpoint)
            with open(part, "ab") as out:
                # http_get sends "Range: bytes=<have>-" and, should the server answer 200
                # instead of 206, truncates back to where this download started.
                http_get(url, CancellableWriter(out, cancel, str(self.uri)),  # type: ignore[arg-type]
                         resume_size=have, expected_size=f.size,
                         headers=build_hf_headers(token=self.token),
                         tqdm_class=_silent_tqdm())
        final = model_dir / f.name
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(part, final)


def _status(e: Any) -> int | None:
    response = getattr(e, "response", None)
    return getattr(response, "status_code", None)


def _remote_file(f: Any) -> RemoteFile:
    if f.lfs is not None:
        return RemoteFile(f.path, int(f.lfs.size), {"algorithm": "sha256", "value": f.lfs.sha256})
    return RemoteFile(f.path, int(f.size), {"algorithm": "git-sha1", "value": f.blob_id})


def _silent_tqdm() -> Any:
    """huggingface_hub's bars stay quiet: ``pulls`` reports progress from the bytes on disk."""
    from tqdm.auto import tqdm

    class Silent(tqdm):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Silent


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Network failures as huggingface_hub's HTTP client raises them (httpx2 from
    huggingface_hub 2, httpx before), and the OS's own; not other OSErrors (a full disk)."""
    errors: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for client in ("httpx2", "httpx"):
        with contextlib.suppress(ImportError):
            errors.append(importlib.import_module(client).TransportError)
    return tuple(errors)

