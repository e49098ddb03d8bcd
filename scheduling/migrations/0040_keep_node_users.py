from django.db import migrations

# The sweep of the node users the control plane keeps (scheduling.services.node_users), as a
# django-celery-beat row, editable in the admin like 0006's.
SCHEDULES = [
    # (name, task, every seconds, description)
    (
        "keep node users",
        "scheduling.tasks.keep_node_users",
        60,
        "Sets each node's own Redis user to the queues of the deployments placed on the node.",
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
        ("scheduling", "0039_autoscale"),
        ("django_celery_beat", "0019_alter_periodictasks_options"),
    ]

    operations = [migrations.RunPython(create_schedules, remove_schedules)]
