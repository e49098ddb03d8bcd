"""What the portal measured or decided about a deployment moves off its row into a record of its own
(DeploymentObserved): the Deployment row keeps the operator's settings (gpuportal.wire.deployment_spec)
and its identity.

The table is made, every deployment's values are copied into it (one row each, in one statement),
then the nine columns leave the deployment table. Backwards, the columns come back (with their
defaults), the values are copied back, and the table goes.
"""

import django.db.models.deletion
from django.db import migrations, models

# The nine columns, in one order for both directions of the copy.
MOVED = (
    "memory_measured_bytes",
    "memory_measured_context_bytes",
    "memory_estimate_bytes",
    "weight_bytes",
    "measured_load_s",
    "measured_wake_s",
    "load_failures",
    "failed_reason",
    "retry_at",
)
COLUMNS = ", ".join(MOVED)

COPY = (
    f"INSERT INTO scheduling_deploymentobserved (deployment_id, {COLUMNS}) "
    f"SELECT id, {COLUMNS} FROM scheduling_deployment"
)
COPY_BACK = (
    f"UPDATE scheduling_deployment d SET ({COLUMNS}) = ({', '.join(f'o.{c}' for c in MOVED)}) "
    "FROM scheduling_deploymentobserved o WHERE o.deployment_id = d.id"
)


class Migration(migrations.Migration):
    dependencies = [
        ("scheduling", "0030_hearing"),
    ]

    operations = [
        migrations.CreateModel(
            name="DeploymentObserved",
            fields=[
                (
                    "deployment",
                    models.OneToOneField(
                        on_delete=django.db.models.deletion.CASCADE,
                        primary_key=True,
                        related_name="observed",
                        serialize=False,
                        to="scheduling.deployment",
                    ),
                ),
                ("memory_measured_bytes", models.BigIntegerField(blank=True, null=True)),
                ("memory_measured_context_bytes", models.BigIntegerField(blank=True, null=True)),
                ("memory_estimate_bytes", models.BigIntegerField(blank=True, null=True)),
                ("weight_bytes", models.BigIntegerField(blank=True, null=True)),
                ("measured_load_s", models.FloatField(blank=True, null=True)),
                ("measured_wake_s", models.FloatField(blank=True, null=True)),
                (
                    "load_failures",
                    models.PositiveIntegerField(db_default=0, default=0, help_text="Consecutive failed loads."),
                ),
                (
                    "failed_reason",
                    models.TextField(
                        blank=True, db_default="", default="", help_text="Set once it gave up: the last load error."
                    ),
                ),
                (
                    "retry_at",
                    models.DateTimeField(
                        blank=True, help_text="When a replacement for a failed load starts.", null=True
                    ),
                ),
            ],
            options={
                "verbose_name": "measured and decided",
                "verbose_name_plural": "measured and decided",
            },
        ),
        migrations.RunSQL(COPY, COPY_BACK),
        *(migrations.RemoveField(model_name="deployment", name=name) for name in MOVED),
    ]
