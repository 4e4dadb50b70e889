# What the cluster needs beside EKS's defaults: the cluster autoscaler (adds a GPU node when a GPU
# runner cannot be placed, removes it when idle), NVIDIA's device plugin (advertises nvidia.com/gpu
# on GPU nodes), and metrics-server (CPU metrics for the gateway's HPA).

resource "helm_release" "cluster_autoscaler" {
  name       = "cluster-autoscaler"
  namespace  = "kube-system"
  repository = "https://kubernetes.github.io/autoscaler"
  chart      = "cluster-autoscaler"
  version    = var.cluster_autoscaler_chart_version

  values = [yamlencode({
    cloudProvider = "aws"
    awsRegion     = var.region
    autoDiscovery = { clusterName = var.cluster_name }
    # The autoscaler's minor version follows the cluster's.
    image = { tag = "v${var.kubernetes_version}.0" }
    rbac = {
      serviceAccount = {
        name        = "cluster-autoscaler"
        annotations = { "eks.amazonaws.com/role-arn" = var.autoscaler_role_arn }
      }
    }
    extraArgs = {
      "balance-similar-node-groups" = true
      "skip-nodes-with-system-pods" = false
      "scale-down-unneeded-time"    = var.scale_down_unneeded_time
      "scale-down-delay-after-add"  = "2m"
      "expander"                    = "least-waste"
    }
    resources = { requests = { cpu = "100m", memory = "300Mi" }, limits = { cpu = "1", memory = "1Gi" } }
  })]
}

resource "helm_release" "nvidia_device_plugin" {
  name             = "nvidia-device-plugin"
  namespace        = "nvidia-device-plugin"
  create_namespace = true
  repository       = "https://nvidia.github.io/k8s-device-plugin"
  chart            = "nvidia-device-plugin"
  version          = var.nvidia_device_plugin_chart_version

  values = [yamlencode({
    nodeSelector = { (var.gpu_node_label_key) = var.gpu_node_label_value }
    tolerations  = [{ key = "nvidia.com/gpu", operator = "Exists", effect = "NoSchedule" }]
  })]
}

resource "helm_release" "metrics_server" {
  name       = "metrics-server"
  namespace  = "kube-system"
  repository = "https://kubernetes-sigs.github.io/metrics-server"
  chart      = "metrics-server"
  version    = var.metrics_server_chart_version
}
