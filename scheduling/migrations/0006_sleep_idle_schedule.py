"""The idle-sleep sweep as a django-celery-beat row, editable in the admin like 0002's schedules."""

from django.db import migrations

SCHEDULES = [
    # (name, task, every seconds, description)
    (
        "sleep idle replicas",
        "scheduling.tasks.sleep_idle",
        5,
        "Puts serving replicas to sleep (weights to CPU RAM) once idle for their deployment's idle_timeout_s.",
    ),
]


def create_schedules(apps, schema_editor):
    IntervalSchedule = apps.get_model("django_celery_beat", "IntervalSchedule")
    PeriodicTask = apps.get_model("django_celery_beat", "PeriodicTask")
    for name, task, every, description in SCHEDULES:
        interval, _ = IntervalSchedule.objects.get_or_create(every=every, period="seconds")
        PeriodicTask.objects.get_or_create(
            name=name,
            defaults={"task": task, "interval": interval, "description": description, "queue": "control"},
        )


def remove_schedules(apps, schema_editor):
    PeriodicTask = apps.get_model("django_celery_beat", "PeriodicTask")
    PeriodicTask.objects.filter(name__in=[name for name, *_ in SCHEDULES]).delete()


class Migration(migrations.Migration):
    dependencies = [
        ("scheduling", "0005_ledger_commit_function"),
        ("django_celery_beat", "0019_alter_periodictasks_options"),
    ]

    operations = [migrations.RunPython(create_schedules, remove_schedules)]
