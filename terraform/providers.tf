provider "aws" {
  region = var.region

  default_tags {
    tags = merge(var.tags, { Project = "fngate", Stack = var.name })
  }
}

# Both Kubernetes providers reach the new cluster with a token from the AWS CLI, so the machine that
# runs Terraform needs `aws` on its PATH and network access to the API endpoint (api_allowed_cidrs).
locals {
  kube_exec = {
    api_version = "client.authentication.k8s.io/v1beta1"
    command     = "aws"
    args        = ["eks", "get-token", "--cluster-name", module.eks.name, "--region", var.region]
  }
}

provider "kubernetes" {
  host                   = module.eks.endpoint
  cluster_ca_certificate = base64decode(module.eks.certificate_authority)

  exec {
    api_version = local.kube_exec.api_version
    command     = local.kube_exec.command
    args        = local.kube_exec.args
  }
}

provider "helm" {
  kubernetes = {
    host                   = module.eks.endpoint
    cluster_ca_certificate = base64decode(module.eks.certificate_authority)
    exec                   = local.kube_exec
  }
}
