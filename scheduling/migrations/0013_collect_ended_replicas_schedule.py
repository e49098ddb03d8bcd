"""The sweep that removes long-ended replicas, as a django-celery-beat row editable in the admin."""

from django.db import migrations

SCHEDULES = [
    # (name, task, every seconds, description)
    (
        "collect ended replicas",
        "scheduling.tasks.collect_ended_replicas",
        300,
        "Removes stopped and failed replicas older than GPUPORTAL_REPLICA_RETENTION_S, keeping the newest "
        "GPUPORTAL_REPLICA_KEEP_ENDED of each deployment for their errors; their Events stay.",
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
        ("scheduling", "0012_gpu_accounting"),
        ("django_celery_beat", "0019_alter_periodictasks_options"),
    ]

    operations = [migrations.RunPython(create_schedules, remove_schedules)]
