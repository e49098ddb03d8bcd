"""Periodic control-plane sweeps, as django-celery-beat rows so operators can edit them in the admin."""

from django.db import migrations

SCHEDULES = [
    # (name, task, every seconds, description)
    (
        "expire node heartbeats",
        "scheduling.tasks.expire_heartbeats",
        5,
        "Marks nodes offline whose agent missed heartbeats for GPUPORTAL_HEARTBEAT_TIMEOUT_S.",
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
        ("scheduling", "0001_initial"),
        ("django_celery_beat", "0019_alter_periodictasks_options"),
    ]

    operations = [migrations.RunPython(create_schedules, remove_schedules)]
