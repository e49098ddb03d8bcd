from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("scheduling", "0028_ledger_gone_v2"),
    ]

    operations = [
        migrations.AddField(
            model_name="replica",
            name="wake_when_asleep",
            field=models.BooleanField(db_default=False, default=False),
        ),
    ]
