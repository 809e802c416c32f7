"""Models on the Hugging Face Hub (or a mirror: `HF_ENDPOINT`; private and gated repos: `HF_TOKEN`),
through `huggingface_hub`.

The listing asks the Hub for the revision's files with their sizes and LFS sha256 and pins the
revision (a branch or tag) to the commit it points at now: that commit is what is downloaded,
logged, cached under, and written into the snapshot fingerprint. Only the serving files come
(listing.SERVING_FILES), or the one GGUF file the reference names; each is downloaded by
`hf_hub_download` at that commit, several at once.
"""

from __future__ import annotations

import logging
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from ferry.worker.models.errors import ModelSourceError, SourceUnreachableError
from ferry.worker.models.sources.listing import Listing, RemoteFile, serving_files
from ferry.worker.models.sources.node_cache import Arrived
from ferry.worker.models.sources.progress import TransferProgress
from ferry.worker.models.sources.refs import ModelRef

log = logging.getLogger("ferry.worker.models")

PARALLEL_FILES = 8  # files downloaded at once (a sharded checkpoint's shards)


def list_files(ref: ModelRef) -> Listing:
    """The serving files of `ref` at the commit its revision points at."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=_endpoint(), token=_token())
    info = _call(ref, api.model_info, ref.repo, revision=ref.revision, files_metadata=True)
    siblings = {s.rfilename: s for s in info.siblings or []}
    at = f"{ref.repo} at {ref.revision or 'its default branch'}"
    if ref.gguf:
        if ref.path not in siblings:
            raise ModelSourceError(f"{ref.text}: no file {ref.path!r} in {at}")
        names = [ref.path]
    else:
        names = serving_files(list(siblings))
        if not names:
            raise ModelSourceError(f"{ref.text}: {at} has no config.json + safetensors weights and no single .gguf "
                                   "file (Ferry serves only those)")
    files = []
    for name in names:
        sibling = siblings[name]
        if sibling.size is None:
            raise ModelSourceError(f"{ref.text}: the Hub gave no size for {name} (an old mirror?)")
        sha256 = sibling.lfs.sha256 if sibling.lfs is not None else None
        files.append(RemoteFile(name.rsplit("/", 1)[-1], name, sibling.size, sha256=sha256))
    log.info("model %s: %s is commit %s", ref.text, ref.revision or "the default branch", info.sha,
             extra={"model": ref.text, "revision": info.sha})
    return Listing(ref, info.sha, tuple(files))


def download(listing: Listing, directory: Path, progress: TransferProgress, arrived: Arrived,
             written=None) -> None:
    """The listing's files at its commit, into `directory`, in the listing's order; `arrived(file)`
    as each is in (whole files: `written` is never called, a loader reads each file once it is in)."""
    from huggingface_hub import hf_hub_download

    ref = listing.ref

    class Counting(tqdm):  # huggingface_hub reports each file's bytes through its tqdm_class
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

        def update(self, n=1):
            progress.advance(int(n or 0))

    def get(file: RemoteFile) -> None:
        got = _call(ref, hf_hub_download, ref.repo, file.key, revision=listing.version, local_dir=directory,
                    endpoint=_endpoint(), token=_token(), tqdm_class=Counting)
        if Path(got).resolve() != (directory / file.name).resolve():
            os.replace(got, directory / file.name)  # a GGUF from a subfolder of the repo
        arrived(file)

    with ThreadPoolExecutor(PARALLEL_FILES, thread_name_prefix="hub-get") as pool:
        for _ in pool.map(get, listing.files):
            pass
    shutil.rmtree(directory / ".cache", ignore_errors=True)  # huggingface_hub's local_dir metadata


def _endpoint() -> str | None:
    return os.environ.get("HF_ENDPOINT") or None  # read at each call: huggingface_hub reads it once at import


def _token() -> str | None:
    return os.environ.get("HF_TOKEN") or None  # None: huggingface_hub's own (a stored login), if any


def _call(ref: ModelRef, fn, *args, **kwargs):
    """`fn` with huggingface_hub's errors turned into one ModelSourceError naming the reference and the cause."""
    import httpx2
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return fn(*args, **kwargs)
    except GatedRepoError:
        cause = "the repository is gated: set HF_TOKEN to a token whose account was granted access"
    except RepositoryNotFoundError:
        cause = f"the repository {ref.repo!r} does not exist (or is private and HF_TOKEN is missing or has no access)"
    except RevisionNotFoundError:
        cause = f"the revision {ref.revision!r} does not exist in {ref.repo!r}"
    except EntryNotFoundError as exc:
        cause = f"a file is missing from the repository: {exc}"
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "?"
        cause = f"the Hub answered HTTP {status}" + (": check HF_TOKEN" if status in (401, 403) else "")
    except (httpx2.ConnectError, httpx2.TimeoutException, OfflineModeIsEnabled) as exc:
        raise SourceUnreachableError(f"{ref.text}: the Hub ({_endpoint() or 'huggingface.co'}) is unreachable: "
                                     f"{exc}") from None
    except OSError as exc:
        if exc.errno is not None:
            raise  # the local disk's (the cache reports it)
        cause = f"the download failed (truncated?): {exc}"
    raise ModelSourceError(f"{ref.text}: {cause}") from None
