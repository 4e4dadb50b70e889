# The EKS cluster: control plane with encrypted secrets and every log type, an OIDC provider for IAM
# roles for service accounts, a CPU node group, and a GPU node group that scales to zero and is
# tainted so that only pods asking for a GPU land there.

data "aws_caller_identity" "current" {}

data "aws_region" "current" {}

data "aws_partition" "current" {}

locals {
  account = data.aws_caller_identity.current.account_id
  region  = data.aws_region.current.region
  # Must match fngate/k8s.py (GPU_NODE_LABEL, GPU_TAINT_KEY): runner pods of GPU pools select this
  # label and tolerate this taint.
  gpu_label = { key = "nvidia.com/gpu.present", value = "true" }
  gpu_taint = { key = "nvidia.com/gpu", value = "true", effect = "NO_SCHEDULE" }
  # cluster-autoscaler's AWS provider knows GPU nodes by this label (GPULabel in
  # cluster-autoscaler/cloudprovider/aws/aws_cloud_provider.go): until the device plugin advertises
  # the GPU it counts such a node as coming up, instead of adding another one for the same pod.
  accelerator_label = { key = "k8s.amazonaws.com/accelerator", value = var.gpu_accelerator }
  # What kubelet makes allocatable of a GPU node's root volume: EKS's AL2023 nodes evict pods below
  # 10 % free (evictionHard nodefs.available) and reserve 1 GiB of ephemeral storage for the system
  # (kubeReserved). A GPU runner requests its artifact cache, /tmp and its TensorRT engine cache.
  gpu_ephemeral_storage_mib = floor(var.gpu_volume_gib * 1024 * 0.9) - 1024
}

module "kms_key" {
  source = "../kms-key"

  description    = "${var.name} EKS secrets and control plane logs"
  log_group_name = "/aws/eks/${var.name}/cluster"
}

# The key used to be declared here; state moves with it instead of a new key replacing it.
moved {
  from = aws_kms_key.this
  to   = module.kms_key.aws_kms_key.this
}

resource "aws_cloudwatch_log_group" "this" {
  name              = "/aws/eks/${var.name}/cluster"
  retention_in_days = var.log_retention_days
  kms_key_id        = module.kms_key.arn
}

# ---------------------------------------------------------------- control plane
data "aws_iam_policy_document" "cluster_trust" {
  statement {
    actions = ["sts:AssumeRole", "sts:TagSession"]
    principals {
      type        = "Service"
      identifiers = ["eks.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "cluster" {
  name               = "${var.name}-eks-cluster"
  assume_role_policy = data.aws_iam_policy_document.cluster_trust.json
}

resource "aws_iam_role_policy_attachment" "cluster" {
  role       = aws_iam_role.cluster.name
  policy_arn = "arn:${data.aws_partition.current.partition}:iam::aws:policy/AmazonEKSClusterPolicy"
}

resource "aws_eks_cluster" "this" {
  #checkov:skip=CKV_AWS_38:public_access_cidrs is var.api_allowed_cidrs, whose validation in the root module refuses 0.0.0.0/0; checkov cannot see a value without a default.
  #checkov:skip=CKV_AWS_39:The public endpoint is what Terraform, kubectl and CI reach; it is restricted to var.api_allowed_cidrs, and the nodes use the private endpoint.
  name                      = var.name
  version                   = var.kubernetes_version
  role_arn                  = aws_iam_role.cluster.arn
  enabled_cluster_log_types = ["api", "audit", "authenticator", "controllerManager", "scheduler"]

  vpc_config {
    subnet_ids              = var.subnet_ids
    endpoint_private_access = true
    endpoint_public_access  = true
    public_access_cidrs     = var.api_allowed_cidrs
  }

  encryption_config {
    resources = ["secrets"]
    provider {
      key_arn = module.kms_key.arn
    }
  }

  access_config {
    authentication_mode                         = "API"
    bootstrap_cluster_creator_admin_permissions = true
  }

  depends_on = [aws_iam_role_policy_attachment.cluster, aws_cloudwatch_log_group.this]
}

resource "aws_eks_access_entry" "admins" {
  for_each = toset(var.admin_role_arns)

  cluster_name  = aws_eks_cluster.this.name
  principal_arn = each.value
}

resource "aws_eks_access_policy_association" "admins" {
  for_each = toset(var.admin_role_arns)

  cluster_name  = aws_eks_cluster.this.name
  principal_arn = each.value
  policy_arn    = "arn:${data.aws_partition.current.partition}:eks::aws:cluster-access-policy/AmazonEKSClusterAdminPolicy"

  access_scope {
    type = "cluster"
  }

  depends_on = [aws_eks_access_entry.admins]
}

resource "aws_iam_openid_connect_provider" "this" {
  url            = aws_eks_cluster.this.identity[0].oidc[0].issuer
  client_id_list = ["sts.amazonaws.com"]
}

# ---------------------------------------------------------------- nodes
data "aws_iam_policy_document" "node_trust" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "node" {
  name               = "${var.name}-eks-node"
  assume_role_policy = data.aws_iam_policy_document.node_trust.json
}

resource "aws_iam_role_policy_attachment" "node" {
  for_each = toset(["AmazonEKSWorkerNodePolicy", "AmazonEKS_CNI_Policy", "AmazonEC2ContainerRegistryReadOnly"])

  role       = aws_iam_role.node.name
  policy_arn = "arn:${data.aws_partition.current.partition}:iam::aws:policy/${each.value}"
}

# IMDSv2 with a hop limit of 1: pods cannot borrow the node's role; they get their own through IRSA.
resource "aws_launch_template" "cpu" {
  name_prefix = "${var.name}-cpu-"

  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
  }

  # Images, and each runner's artifact cache (its ephemeral-storage request, runner_artifact_cache_gib).
  block_device_mappings {
    device_name = "/dev/xvda"
    ebs {
      volume_size           = var.cpu_volume_gib
      volume_type           = "gp3"
      encrypted             = true
      delete_on_termination = true
    }
  }
}

resource "aws_launch_template" "gpu" {
  name_prefix = "${var.name}-gpu-"

  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
  }

  # The GPU runner image (CUDA, cuDNN, TensorRT) is large, and so are TensorRT engine caches.
  block_device_mappings {
    device_name = "/dev/xvda"
    ebs {
      volume_size           = var.gpu_volume_gib
      volume_type           = "gp3"
      encrypted             = true
      delete_on_termination = true
    }
  }
}

resource "aws_eks_node_group" "cpu" {
  cluster_name    = aws_eks_cluster.this.name
  node_group_name = "cpu"
  node_role_arn   = aws_iam_role.node.arn
  subnet_ids      = var.subnet_ids
  ami_type        = "AL2023_x86_64_STANDARD"
  instance_types  = var.cpu_instance_types

  scaling_config {
    min_size     = var.cpu_min_size
    max_size     = var.cpu_max_size
    desired_size = var.cpu_min_size
  }

  update_config {
    max_unavailable = 1
  }

  launch_template {
    id      = aws_launch_template.cpu.id
    version = aws_launch_template.cpu.latest_version
  }

  labels = { "fngate/node-class" = "cpu" }

  # The cluster autoscaler owns the size between min and max.
  lifecycle {
    ignore_changes = [scaling_config[0].desired_size]
  }

  depends_on = [aws_iam_role_policy_attachment.node]
}

resource "aws_eks_node_group" "gpu" {
  cluster_name    = aws_eks_cluster.this.name
  node_group_name = "gpu"
  node_role_arn   = aws_iam_role.node.arn
  subnet_ids      = var.subnet_ids
  ami_type        = "AL2023_x86_64_NVIDIA"
  instance_types  = var.gpu_instance_types

  # Zero GPU nodes while no GPU runner is wanted: the cluster autoscaler adds one when KEDA scales a
  # GPU pool up and its pod cannot be placed, and removes it once the pool is back at zero.
  scaling_config {
    min_size     = 0
    max_size     = var.gpu_max_size
    desired_size = 0
  }

  update_config {
    max_unavailable = 1
  }

  launch_template {
    id      = aws_launch_template.gpu.id
    version = aws_launch_template.gpu.latest_version
  }

  labels = {
    "fngate/node-class"           = "gpu"
    (local.gpu_label.key)         = local.gpu_label.value
    (local.accelerator_label.key) = local.accelerator_label.value
  }

  taint {
    key    = local.gpu_taint.key
    value  = local.gpu_taint.value
    effect = local.gpu_taint.effect
  }

  lifecycle {
    ignore_changes = [scaling_config[0].desired_size]
  }

  depends_on = [aws_iam_role_policy_attachment.node]
}

# What a GPU node would bring, for the cluster autoscaler to scale the group up from zero nodes,
# when there is no node yet to look at: every resource a GPU runner requests beyond the instance
# type's CPUs and memory (which the autoscaler knows), and the label and taint its selector and
# toleration match. cluster-autoscaler learns a node's ephemeral storage from this tag alone; without
# it, a pod that requests any stays Pending with the group at zero.
resource "aws_autoscaling_group_tag" "gpu_template" {
  for_each = {
    "k8s.io/cluster-autoscaler/node-template/label/${local.gpu_label.key}"         = local.gpu_label.value
    "k8s.io/cluster-autoscaler/node-template/label/${local.accelerator_label.key}" = local.accelerator_label.value
    "k8s.io/cluster-autoscaler/node-template/taint/${local.gpu_taint.key}"         = "${local.gpu_taint.value}:NoSchedule"
    "k8s.io/cluster-autoscaler/node-template/resources/nvidia.com/gpu"             = tostring(var.gpus_per_node)
    "k8s.io/cluster-autoscaler/node-template/resources/ephemeral-storage"          = "${local.gpu_ephemeral_storage_mib}Mi"
  }

  autoscaling_group_name = aws_eks_node_group.gpu.resources[0].autoscaling_groups[0].name

  tag {
    key                 = each.key
    value               = each.value
    propagate_at_launch = false
  }
}

# ---------------------------------------------------------------- network policy enforcement
# The VPC CNI enforces NetworkPolicies only with its network policy agent on, which is off by
# default; fngate's objects (fngate/k8s.py) restrict what reaches gateways and runners.
# The add-on replaces the CNI that EKS installs unmanaged (OVERWRITE takes over its settings).
data "aws_eks_addon_version" "vpc_cni" {
  addon_name         = "vpc-cni"
  kubernetes_version = aws_eks_cluster.this.version
  most_recent        = false
}

resource "aws_eks_addon" "vpc_cni" {
  cluster_name                = aws_eks_cluster.this.name
  addon_name                  = "vpc-cni"
  addon_version               = data.aws_eks_addon_version.vpc_cni.version
  resolve_conflicts_on_create = "OVERWRITE"
  resolve_conflicts_on_update = "OVERWRITE"
  configuration_values        = jsonencode({ enableNetworkPolicy = "true" })
}

# ---------------------------------------------------------------- the cluster autoscaler's permissions
data "aws_iam_policy_document" "cluster_autoscaler" {
  statement {
    sid = "Discover"
    # Describe calls of Auto Scaling and EC2 support no resource-level permissions.
    actions = [
      "autoscaling:DescribeAutoScalingGroups",
      "autoscaling:DescribeAutoScalingInstances",
      "autoscaling:DescribeLaunchConfigurations",
      "autoscaling:DescribeScalingActivities",
      "autoscaling:DescribeTags",
      "ec2:DescribeImages",
      "ec2:DescribeInstanceTypes",
      "ec2:DescribeLaunchTemplateVersions",
      "ec2:GetInstanceTypesFromInstanceRequirements",
    ]
    resources = ["*"]
  }

  statement {
    sid       = "ReadNodeGroups"
    actions   = ["eks:DescribeNodegroup"]
    resources = ["arn:${data.aws_partition.current.partition}:eks:${local.region}:${local.account}:nodegroup/${var.name}/*"]
  }

  statement {
    sid = "ScaleOwnNodeGroups"
    # The condition limits these to the Auto Scaling groups tagged as this cluster's (EKS names them).
    actions   = ["autoscaling:SetDesiredCapacity", "autoscaling:TerminateInstanceInAutoScalingGroup"]
    resources = ["*"]
    condition {
      test     = "StringEquals"
      variable = "aws:ResourceTag/k8s.io/cluster-autoscaler/${var.name}"
      values   = ["owned"]
    }
  }
}
