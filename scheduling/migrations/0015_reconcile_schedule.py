"""The reconcile sweep as a django-celery-beat row, editable in the admin: besides node events and
crashes, every deployment is brought back to its replicas now and then."""

from django.db import migrations

SCHEDULES = [
    # (name, task, every seconds, description)
    (
        "reconcile deployments",
        "scheduling.tasks.reconcile",
        30,
        "Places what each deployment lacks of its replicas (sleeping ones count; none is stopped).",
    ),
]


def create_schedules(apps, schema_editor):
    IntervalSchedule = apps.get_model("django_celery_beat", "IntervalSchedule")
    PeriodicTask = apps.get_model("django_celery_beat", "PeriodicTask")
    for name, task, every, description in SCHEDULES:
        interval, _ = IntervalSchedule.objects.get_or_create(every=every, period="seconds")
        PeriodicTask.objects.get_or_create(
            name=name,
            defaults={
                "task": task,
                "interval": interval,
                "description": description,
                "queue": "control",
                "args": '["the periodic sweep"]',
            },
        )


def remove_schedules(apps, schema_editor):
    PeriodicTask = apps.get_model("django_celery_beat", "PeriodicTask")
    PeriodicTask.objects.filter(name__in=[name for name, *_ in SCHEDULES]).delete()


class Migration(migrations.Migration):
    dependencies = [
        ("scheduling", "0014_crash_loop_backoff"),
        ("django_celery_beat", "0019_alter_periodictasks_options"),
    ]

    operations = [migrations.RunPython(create_schedules, remove_schedules)]
