"""Terraform without a terraform binary: every .tf parses, and the properties the deployment
depends on hold in the parsed HCL (scale to zero, encryption, no public buckets, least
privilege on S3, validated variables, tags, pinned providers)."""

import re

import pytest

from ferry.worker.webhooks.settings import WebhookSettings
from ferry.worker.webhooks.tasks import visibility_timeout_s
from tests.infra.hcl import TERRAFORM, first, load_dir, module_dirs, one

MODULES = {p.name: load_dir(p) for p in module_dirs()}
DEV = load_dir(TERRAFORM / "envs" / "dev")

# AWS resources that accept tags and that these modules create.
TAGGABLE = {
    "aws_vpc", "aws_default_security_group", "aws_internet_gateway", "aws_subnet", "aws_eip",
    "aws_nat_gateway", "aws_route_table", "aws_vpc_endpoint", "aws_kms_key", "aws_cloudwatch_log_group",
    "aws_iam_role", "aws_flow_log", "aws_secretsmanager_secret", "aws_elasticache_subnet_group",
    "aws_security_group", "aws_vpc_security_group_ingress_rule", "aws_elasticache_replication_group",
    "aws_s3_bucket", "aws_eks_cluster", "aws_iam_openid_connect_provider", "aws_launch_template",
    "aws_eks_node_group", "aws_sqs_queue",
}  # fmt: skip


def test_every_tf_file_parses_and_modules_are_complete():
    assert set(MODULES) == {"network", "redis", "snapshots", "gpu_pool", "iam", "celery_queue"}
    for name, blocks in MODULES.items():
        files = {b.path.name for b in blocks}
        assert {"main.tf", "variables.tf", "outputs.tf", "versions.tf"} <= files, name
    assert {b.name for b in DEV if b.kind == "module"} == set(MODULES)


def test_providers_are_pinned():
    dev = one(DEV, "terraform", "")
    providers = first(dev.body["required_providers"])
    for name in ("aws", "helm", "random", "tls"):
        assert re.fullmatch(r"\d+\.\d+\.\d+", providers[name]["version"]), f"{name} not pinned exactly"
    for name, blocks in MODULES.items():
        aws = first(one(blocks, "terraform", "").body["required_providers"])["aws"]
        assert "< 6.0.0" in aws["version"], f"{name}: aws provider needs an upper bound"


def test_every_variable_has_a_description_and_type_and_inputs_are_validated():
    for name, blocks in [*MODULES.items(), ("envs/dev", DEV)]:
        for v in (b for b in blocks if b.kind == "variable"):
            assert v.body.get("description"), f"{name}: variable {v.name} lacks a description"
            assert "type" in v.body, f"{name}: variable {v.name} lacks a type"
    must_validate = {
        "network": {"name", "cidr_block", "availability_zones"},
        "redis": {"name", "node_type", "engine_version"},
        "snapshots": {"bucket_name", "snapshot_prefix"},
        "gpu_pool": {"gpu_instance_types", "gpu_min_size", "gpu_max_size", "gpu_capacity_type", "public_access_cidrs"},
        "iam": {"snapshot_bucket_arn", "snapshot_prefix", "celery_queue_arn"},
        "celery_queue": {"name", "key_prefix", "visibility_timeout_s", "max_receive_count"},
    }
    for module, names in must_validate.items():
        validated = {b.name for b in MODULES[module] if b.kind == "variable" and "validation" in b.body}
        assert names <= validated, f"{module}: {names - validated} unvalidated"


def test_every_taggable_resource_is_tagged():
    for name, blocks in MODULES.items():
        for r in (b for b in blocks if b.kind == "resource" and b.type in TAGGABLE):
            assert "tags" in r.body, f"{name}: {r.type}.{r.name} has no tags"
    assert "default_tags" in (TERRAFORM / "envs" / "dev" / "versions.tf").read_text()


def test_gpu_pool_scales_to_zero_with_taint_and_label():
    gpu = one(MODULES["gpu_pool"], "resource", "aws_eks_node_group", "gpu")
    assert one(MODULES["gpu_pool"], "variable", "", "gpu_min_size").body["default"] == 0
    assert first(gpu.body["scaling_config"])["min_size"] == "${var.gpu_min_size}"
    dev_pool = one(DEV, "module", "", "gpu_pool").body
    assert dev_pool["gpu_min_size"] == 0
    assert first(gpu.body["taint"])["effect"] == "NO_SCHEDULE"
    assert "NVIDIA" in gpu.body["ami_type"]
    assert gpu.body["instance_types"] == "${var.gpu_instance_types}"
    assert "desired_size" in str(first(gpu.body["lifecycle"])["ignore_changes"])
    # The cluster autoscaler can only scale a group up from zero if the ASG says what a node offers.
    locals_text = (TERRAFORM / "modules" / "gpu_pool" / "main.tf").read_text()
    assert "node-template/resources/nvidia.com/gpu" in locals_text
    assert "node-template/taint/" in locals_text and "node-template/label/" in locals_text
    releases = {b.name: b.body for b in MODULES["gpu_pool"] if b.type == "helm_release"}
    assert {"nvidia_device_plugin", "keda", "cluster_autoscaler"} <= set(releases)
    assert all(re.fullmatch(r"\$\{var\.chart_versions\.\w+\}", r["version"]) for r in releases.values())


def test_gpu_pool_cluster_is_private_encrypted_and_logged():
    cluster = one(MODULES["gpu_pool"], "resource", "aws_eks_cluster").body
    vpc = first(cluster["vpc_config"])
    assert vpc["endpoint_private_access"] is True
    assert "0.0.0.0/0" not in str(vpc["public_access_cidrs"])
    assert first(cluster["encryption_config"])["resources"] == ["secrets"]
    assert {"api", "audit", "authenticator"} <= set(cluster["enabled_cluster_log_types"])
    for lt in (b for b in MODULES["gpu_pool"] if b.type == "aws_launch_template"):
        meta = first(lt.body["metadata_options"])
        assert meta["http_tokens"] == "required" and meta["http_put_response_hop_limit"] == 1
        assert first(first(lt.body["block_device_mappings"])["ebs"])["encrypted"] is True


def test_redis_is_a_cluster_encrypted_authenticated_and_redis7():
    rg = one(MODULES["redis"], "resource", "aws_elasticache_replication_group").body
    assert rg["at_rest_encryption_enabled"] is True and rg["transit_encryption_enabled"] is True
    assert rg["kms_key_id"].startswith("${aws_kms_key.")
    assert rg["auth_token"] == "${random_password.auth.result}"
    assert rg["cluster_mode"] == "enabled" and rg["parameter_group_name"] == "default.redis7.cluster.on"
    assert rg["num_node_groups"] == "${var.num_node_groups}"
    assert rg["replicas_per_node_group"] == "${var.replicas_per_node_group}"
    assert rg["automatic_failover_enabled"] is True  # cluster mode refuses it off
    assert rg["multi_az_enabled"] == "${var.replicas_per_node_group > 0}"
    endpoint = one(MODULES["redis"], "output", "", "configuration_endpoint").body["value"]
    assert "configuration_endpoint_address" in endpoint
    assert one(MODULES["redis"], "variable", "", "engine_version").body["default"].startswith("7")
    dev = one(DEV, "module", "", "redis").body
    assert dev["num_node_groups"] == "${var.redis_num_node_groups}"
    assert dev["replicas_per_node_group"] == "${var.redis_replicas_per_node_group}"


def test_celery_queue_is_kms_encrypted_with_a_dead_letter_queue():
    q = MODULES["celery_queue"]
    tasks = one(q, "resource", "aws_sqs_queue", "tasks").body
    dlq = one(q, "resource", "aws_sqs_queue", "dead_letter").body
    for queue in (tasks, dlq):
        assert queue["kms_master_key_id"] == "${aws_kms_key.queue.arn}"
    assert "aws_sqs_queue.dead_letter.arn" in tasks["redrive_policy"]
    assert "maxReceiveCount" in tasks["redrive_policy"]
    assert "aws_sqs_queue.tasks.arn" in one(q, "resource", "aws_sqs_queue_redrive_allow_policy").body[
        "redrive_allow_policy"]
    # The queue outlasts the longest webhook backoff the tasks may hold a message through.
    default = one(q, "variable", "", "visibility_timeout_s").body["default"]
    assert tasks["visibility_timeout_seconds"] == "${var.visibility_timeout_s}"
    assert visibility_timeout_s(WebhookSettings()) <= default <= 43200
    assert all(k.body.get("enable_key_rotation") is True for k in q if k.type == "aws_kms_key")


def test_api_role_may_use_only_the_celery_queue_in_sqs():
    api = one(MODULES["iam"], "data", "aws_iam_policy_document", "api").body["statement"]
    sqs = [s for s in api if any(a.startswith("sqs:") for a in s["actions"])]
    assert len(sqs) == 1 and sqs[0]["resources"] == ["${var.celery_queue_arn}"]
    assert not any("*" in a for a in sqs[0]["actions"])
    assert "sqs:CreateQueue" not in sqs[0]["actions"]  # the queue is predefined (FERRY_CELERY_SQS_QUEUE_URL)
    worker = one(MODULES["iam"], "data", "aws_iam_policy_document", "worker").body["statement"]
    assert not any(a.startswith("sqs:") for s in worker for a in s["actions"])


def test_snapshot_bucket_is_private_versioned_kms_tls_only_and_expires_old_versions():
    b = MODULES["snapshots"]
    pab = one(b, "resource", "aws_s3_bucket_public_access_block").body
    assert all(pab[k] is True for k in ("block_public_acls", "block_public_policy", "ignore_public_acls",
                                       "restrict_public_buckets"))  # fmt: skip
    versioning = one(b, "resource", "aws_s3_bucket_versioning").body
    assert first(versioning["versioning_configuration"])["status"] == "Enabled"
    sse = first(
        first(one(b, "resource", "aws_s3_bucket_server_side_encryption_configuration").body["rule"])[
            "apply_server_side_encryption_by_default"
        ]
    )
    assert sse["sse_algorithm"] == "aws:kms" and sse["kms_master_key_id"].startswith("${aws_kms_key.")
    rules = one(b, "resource", "aws_s3_bucket_lifecycle_configuration").body["rule"]
    assert any("noncurrent_version_expiration" in r for r in rules)
    assert any("abort_incomplete_multipart_upload" in r for r in rules)
    policy = one(b, "data", "aws_iam_policy_document", "bucket").body["statement"]
    tls = [s for s in policy if s.get("sid") == "DenyInsecureTransport"]
    assert tls and tls[0]["effect"] == "Deny"
    assert first(tls[0]["condition"])["variable"] == "aws:SecureTransport"
    assert all(k.body.get("enable_key_rotation") is True for k in b if k.type == "aws_kms_key")


def _allow_statements(blocks):
    for doc in (b for b in blocks if b.type == "aws_iam_policy_document"):
        for s in doc.body.get("statement", []):
            if s.get("effect", "Allow") == "Allow":
                yield doc.name, s


def test_no_wildcard_s3_actions_are_allowed_anywhere():
    for name, blocks in MODULES.items():
        for doc, s in _allow_statements(blocks):
            for action in s.get("actions", []):
                assert action != "*" and not action.startswith("s3:*"), f"{name}/{doc}: {action}"
                if action.startswith("s3:"):
                    assert "*" not in action, f"{name}/{doc}: wildcard S3 action {action}"


def test_worker_touches_only_its_snapshot_prefix_and_api_no_s3():
    iam = MODULES["iam"]
    worker = one(iam, "data", "aws_iam_policy_document", "worker").body["statement"]
    for s in worker:
        for action in s["actions"]:
            if not action.startswith("s3:"):
                continue
            if action == "s3:ListBucket":
                assert s["resources"] == ["${var.snapshot_bucket_arn}"]
                assert first(s["condition"])["values"] == ["${var.snapshot_prefix}/*"]
            else:
                assert s["resources"] == ["${var.snapshot_bucket_arn}/${var.snapshot_prefix}/*"], action
    api = one(iam, "data", "aws_iam_policy_document", "api").body["statement"]
    denied = [s for s in api if s.get("effect") == "Deny"]
    assert len(denied) == 1 and denied[0]["actions"] == ["s3:*"] and denied[0]["resources"] == ["*"]
    assert not any(a.startswith("s3:") for s in api if s.get("effect", "Allow") == "Allow" for a in s["actions"])
    # Both roles are IRSA roles bound to one service account each.
    assume = one(iam, "data", "aws_iam_policy_document", "assume").body
    conditions = {c["variable"]: c["values"] for c in first(assume["statement"])["condition"]}
    assert conditions["${var.oidc_issuer}:sub"] == ["system:serviceaccount:${var.namespace}:${each.value}"]
    assert conditions["${var.oidc_issuer}:aud"] == ["sts.amazonaws.com"]


def test_network_has_private_subnets_nat_and_s3_endpoint():
    n = MODULES["network"]
    assert one(n, "resource", "aws_subnet", "public").body["map_public_ip_on_launch"] is False
    one(n, "resource", "aws_nat_gateway")
    endpoint = one(n, "resource", "aws_vpc_endpoint", "s3").body
    assert endpoint["vpc_endpoint_type"] == "Gateway" and endpoint["service_name"].endswith(".s3")
    assert "aws_route_table.private" in endpoint["route_table_ids"]
    one(n, "resource", "aws_flow_log")


@pytest.mark.parametrize("output", ["redis_endpoint", "snapshot_bucket", "cluster_name", "worker_role_arn"])
def test_dev_environment_outputs(output):
    assert one(DEV, "output", "", output).body["description"]
