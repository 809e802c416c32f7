"""CloudWatch publishing and the ASG/ECS actuators over HTTP, against moto's server mode."""

import socket
from datetime import UTC, datetime, timedelta

import boto3
import pytest
from moto.server import ThreadedMotoServer

from ferry.autoscaler.policy import Decision, Observation
from ferry.autoscaler.publish import AsgActuator, CloudWatchPublisher, EcsActuator
from ferry.autoscaler.settings import AutoscalerSettings, parse_pairs

pytestmark = pytest.mark.s3  # the marker for tests that need moto's server mode


@pytest.fixture(scope="module")
def aws(tmp_path_factory):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    creds = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}
    yield lambda service: boto3.client(service, endpoint_url=f"http://127.0.0.1:{port}", **creds)
    server.stop()


def test_cloudwatch_gets_desired_live_and_backlog(aws):
    cw = aws("cloudwatch")
    now = datetime.now(UTC)
    pub = CloudWatchPublisher(cw, "FerryTest")
    pub.publish("llama", Observation(0, lag=30, pending=10, live_workers=2), Decision(0, 5, 5, "up"))
    metrics = cw.list_metrics(Namespace="FerryTest")["Metrics"]
    names = {m["MetricName"] for m in metrics}
    assert names == {"DesiredWorkers", "LiveWorkers", "Backlog", "BacklogPerWorker"}
    assert all(m["Dimensions"] == [{"Name": "Model", "Value": "llama"}] for m in metrics)
    data = cw.get_metric_data(
        MetricDataQueries=[
            {
                "Id": name.lower(),
                "MetricStat": {
                    "Metric": {
                        "Namespace": "FerryTest",
                        "MetricName": name,
                        "Dimensions": [{"Name": "Model", "Value": "llama"}],
                    },
                    "Period": 60,
                    "Stat": "Maximum",
                },
            }
            for name in ("DesiredWorkers", "BacklogPerWorker")
        ],
        StartTime=now - timedelta(minutes=5),
        EndTime=now + timedelta(minutes=5),
    )["MetricDataResults"]
    assert {d["Id"]: d["Values"] for d in data} == {"desiredworkers": [5.0], "backlogperworker": [20.0]}


def test_asg_actuator_sets_desired_capacity(aws):
    ec2, asg = aws("ec2"), aws("autoscaling")
    ami = "ami-0123456789abcdef0"  # moto does not check that the image exists
    ec2.create_launch_template(
        LaunchTemplateName="gpu", LaunchTemplateData={"ImageId": ami, "InstanceType": "g5.xlarge"}
    )
    asg.create_auto_scaling_group(
        AutoScalingGroupName="ferry-gpu-llama",
        LaunchTemplate={"LaunchTemplateName": "gpu"},
        MinSize=0,
        MaxSize=4,
        DesiredCapacity=0,
        AvailabilityZones=["us-east-1a"],
    )
    AsgActuator(asg, {"llama": "ferry-gpu-llama"}).apply("llama", 3)
    AsgActuator(asg, {"llama": "ferry-gpu-llama"}).apply("other", 1)  # not mapped: no call
    group = asg.describe_auto_scaling_groups(AutoScalingGroupNames=["ferry-gpu-llama"])["AutoScalingGroups"][0]
    assert group["DesiredCapacity"] == 3


def test_ecs_actuator_sets_desired_count(aws):
    ecs = aws("ecs")
    ecs.create_cluster(clusterName="ferry")
    ecs.register_task_definition(
        family="worker", containerDefinitions=[{"name": "worker", "image": "ferry-worker", "memory": 512}]
    )
    ecs.create_service(cluster="ferry", serviceName="worker-llama", taskDefinition="worker", desiredCount=0)
    EcsActuator(ecs, {"llama": "ferry/worker-llama"}).apply("llama", 2)
    service = ecs.describe_services(cluster="ferry", services=["worker-llama"])["services"][0]
    assert service["desiredCount"] == 2


def test_settings_from_env_build_the_policy_and_targets(monkeypatch):
    monkeypatch.setenv("FERRY_AUTOSCALE_MODELS", "a, b")
    monkeypatch.setenv("FERRY_AUTOSCALE_MAX_WORKERS", "3")
    monkeypatch.setenv("FERRY_AUTOSCALE_ASG_NAMES", "a=asg-a,b=asg-b")
    s = AutoscalerSettings()
    assert s.models() == ["a", "b"] and s.policy().max_workers == 3
    assert parse_pairs(s.autoscale_asg_names) == {"a": "asg-a", "b": "asg-b"}
    with pytest.raises(ValueError):
        parse_pairs("no-equals-sign")
