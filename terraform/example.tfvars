# An example: copy to terraform.tfvars (or pass with -var-file) and change what differs for you.
name   = "fngate"
region = "eu-west-1"

# The networks that administer the cluster (Terraform, kubectl): your office or VPN egress.
api_allowed_cidrs = ["203.0.113.0/24"]

# The networks that call the gateway (its load balancer is internal unless gateway_internal = false),
# and the ACM certificate for HTTPS on it.
gateway_allowed_cidrs   = ["10.0.0.0/8"]
gateway_certificate_arn = "arn:aws:acm:eu-west-1:123456789012:certificate/00000000-0000-0000-0000-000000000000"

# Images built from the Dockerfile and pushed to ECR (see docs/deployment.md).
gateway_image    = "123456789012.dkr.ecr.eu-west-1.amazonaws.com/fngate/gateway:0.1.0"
runner_image     = "123456789012.dkr.ecr.eu-west-1.amazonaws.com/fngate/runner:0.1.0"
runner_gpu_image = "123456789012.dkr.ecr.eu-west-1.amazonaws.com/fngate/runner-gpu:0.1.0"

repo_prefix        = "prod"
deployer_role_arns = ["arn:aws:iam::123456789012:role/ci-deploy"]

cpu_instance_types = ["m7i.xlarge"]
gpu_instance_types = ["g5.xlarge"]
gpu_max_size       = 2

# Functions deployed and synced (docs/deployment.md, step 4): only these get runner pools. Empty on
# the first apply; add a function once `fngate deploy` and the registry-sync job have run.
deployed_functions = []

keda_polling_interval_s = 5
keda_cooldown_s         = 300

tags = {
  Owner = "ml-platform"
}
