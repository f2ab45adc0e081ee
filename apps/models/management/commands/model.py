"""``manage.py model list | download <id> | verify <id> | import <path>``: the catalog from the command line.

The same services the API's Celery tasks and the admin use, run here in the foreground.
"""

import sys

from django.core.management.base import BaseCommand, CommandError

from apps.core.errors import IgnisError


class Command(BaseCommand):
    help = "Manage model artifacts (the catalog)."

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="action", required=True)
        sub.add_parser("list", help="list catalog entries and whether they are on disk")
        dl = sub.add_parser("download", help="fetch a known model into the models directory")
        dl.add_argument("served_id")
        dl.add_argument("--force", action="store_true", help="fetch again even if a verified copy is on disk")
        vf = sub.add_parser("verify", help="check an artifact's sha256 against the recorded one")
        vf.add_argument("served_id")
        im = sub.add_parser("import", help="add an artifact already in the models directory to the catalog")
        im.add_argument("path", help="a .gguf file or a Hugging Face directory, relative to the models directory")
        im.add_argument("--id", dest="import_id", default=None, help="served id (default: the file or folder name)")

    def handle(self, *args, action, **options):
        try:
            getattr(self, f"do_{action}")(**options)
        except IgnisError as err:
            raise CommandError(err.message) from None

    def _echo(self, art) -> None:
        pct = art.progress_percent
        sys.stdout.write(
            f"\r{art.served_id}: {art.progress_bytes}/{art.progress_total} bytes"
            + (f" ({pct:.0f}%)" if pct is not None else "")
        )
        sys.stdout.flush()

    def do_list(self, **options):
        from apps.models.catalog import artifact_sync

        rows = [("ID", "STATE", "FORMAT", "SIZE", "PATH", "SOURCE")]
        for art in artifact_sync():
            size = f"{art.size_bytes / (1 << 20):.1f} MiB" if art.size_bytes else "-"
            rows.append((art.served_id, art.state, art.format or "-", size, art.path or "-", art.source or "-"))
        widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]) - 1)]
        for row in rows:
            self.stdout.write("  ".join(str(v).ljust(w) for v, w in zip(row, widths)) + "  " + str(row[-1]))

    def do_download(self, served_id, force=False, **options):
        from apps.models.catalog import artifact_download_run, artifact_sync, artifact_verify
        from apps.models.download import KNOWN_DOWNLOADS

        if served_id not in KNOWN_DOWNLOADS:
            raise CommandError(f"unknown model {served_id!r}; known: {', '.join(KNOWN_DOWNLOADS)}")
        if not force:
            artifact_sync()
            try:
                clean, got, _ = artifact_verify(served_id=served_id)
            except IgnisError:
                clean = False  # not in the catalog or not on disk: fetch it
            if clean:
                self.stdout.write(
                    f"{served_id}: already on disk, sha256 {got} verified; nothing to do (--force refetches)"
                )
                return
        art = artifact_download_run(served_id=served_id, echo=self._echo)
        self.stdout.write(f"\n{served_id}: {art.path} sha256 {art.sha256}")

    def do_verify(self, served_id, **options):
        from apps.models.catalog import artifact_sync, artifact_verify

        artifact_sync()
        try:
            clean, got, want = artifact_verify(served_id=served_id)
        except IgnisError as err:
            raise CommandError(f"{err.message} Fetch it with `python manage.py model download {served_id}`.") from None
        if not clean:
            raise CommandError(f"{served_id}: sha256 {got} does not match the recorded {want}")
        self.stdout.write(f"{served_id}: ok ({got})")

    def do_import(self, path, import_id=None, **options):
        from apps.models.catalog import artifact_import_now

        art = artifact_import_now(path=path, served_id=import_id, echo=self._echo)
        self.stdout.write(f"\n{art.served_id}: {art.path} ({art.format}) sha256 {art.sha256}")
