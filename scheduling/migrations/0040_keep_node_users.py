from django.db import migrations

from scheduling.migrations._beat import schedule_functions

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

create_schedules, remove_schedules = schedule_functions(SCHEDULES)


class Migration(migrations.Migration):
    dependencies = [
        ("scheduling", "0039_autoscale"),
        ("django_celery_beat", "0019_alter_periodictasks_options"),
    ]

    operations = [migrations.RunPython(create_schedules, remove_schedules)]
