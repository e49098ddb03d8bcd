import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gpuportal.settings")
# Django's system checks read the whole URLconf (every view, DRF, the schema generator): about a
# second of CPU at each worker's and beat's start, and a stack starts several. They run once per
# release where the configuration is decided, in `migrate` (the Kubernetes Job and its init
# containers) and in `up`'s prepare_database; a worker started by hand can still ask with
# CELERY_SKIP_CHECKS="".
os.environ.setdefault("CELERY_SKIP_CHECKS", "1")

app = Celery("gpuportal")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
