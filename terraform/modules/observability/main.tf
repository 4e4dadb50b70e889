# Traces and metrics: an OpenTelemetry collector that gateways and runners send traces to over
# OTLP/HTTP, Prometheus (kube-prometheus-stack, optional) scraping their /metrics, and fngate's alert
# rules. fngate's metrics are Prometheus only; the collector's metrics pipeline serves other senders.

locals {
  rules = yamldecode(file(var.rules_file))
  exporters = var.otlp_export_endpoint == "" ? {
    debug = { verbosity = "basic" }
    } : {
    otlphttp = { endpoint = var.otlp_export_endpoint }
  }
}

resource "helm_release" "otel_collector" {
  name             = "otel-collector"
  namespace        = var.namespace
  create_namespace = true
  repository       = "https://open-telemetry.github.io/opentelemetry-helm-charts"
  chart            = "opentelemetry-collector"
  version          = var.otel_collector_chart_version

  values = [yamlencode({
    mode             = "deployment"
    fullnameOverride = "otel-collector"
    image            = { repository = "otel/opentelemetry-collector-contrib" }
    replicaCount     = 2
    resources        = { requests = { cpu = "100m", memory = "256Mi" }, limits = { cpu = "1", memory = "1Gi" } }
    config = {
      receivers  = { otlp = { protocols = { grpc = { endpoint = "$${env:MY_POD_IP}:4317" }, http = { endpoint = "$${env:MY_POD_IP}:4318" } } } }
      processors = { batch = {}, memory_limiter = { check_interval = "5s", limit_percentage = 80, spike_limit_percentage = 25 } }
      exporters  = local.exporters
      service = {
        pipelines = {
          traces  = { receivers = ["otlp"], processors = ["memory_limiter", "batch"], exporters = keys(local.exporters) }
          metrics = { receivers = ["otlp"], processors = ["memory_limiter", "batch"], exporters = keys(local.exporters) }
        }
      }
    }
  })]
}

resource "helm_release" "prometheus" {
  count = var.install_prometheus ? 1 : 0

  name             = "prometheus"
  namespace        = var.namespace
  create_namespace = true
  repository       = "https://prometheus-community.github.io/helm-charts"
  chart            = "kube-prometheus-stack"
  version          = var.prometheus_stack_chart_version

  # Pick up PrometheusRules and PodMonitors from every namespace, not only this release's.
  values = [yamlencode({
    prometheus = {
      prometheusSpec = {
        ruleSelectorNilUsesHelmValues           = false
        podMonitorSelectorNilUsesHelmValues     = false
        serviceMonitorSelectorNilUsesHelmValues = false
        retention                               = "15d"
      }
    }
  })]

  depends_on = [helm_release.otel_collector]
}

# Prometheus's API key for the gateways' /metrics (an admin route): the key in a Secret beside the
# PodMonitor, only its '<id>:<sha256>' to the gateways (output metrics_key_hash).
resource "random_id" "metrics_key" {
  byte_length = 6
}

resource "random_password" "metrics_key" {
  length           = 43
  override_special = "-_"
}

locals {
  metrics_key        = "fng_${random_id.metrics_key.hex}_${random_password.metrics_key.result}"
  metrics_key_secret = "fngate-metrics-key"
}

resource "kubernetes_secret_v1" "metrics_key" {
  metadata {
    name      = local.metrics_key_secret
    namespace = var.namespace
  }

  data = {
    key = local.metrics_key
  }

  depends_on = [helm_release.otel_collector] # which creates the namespace
}

# fngate's alert rules (deploy/prometheus/rules.yaml) and what Prometheus scrapes: the gateway's
# /metrics on its http port and the runners' on their metrics port. Both live in fngate's namespace,
# beside what they watch; Prometheus selects rules and monitors from every namespace (above).
resource "helm_release" "fngate_monitoring" {
  name      = "fngate-monitoring"
  namespace = var.fngate_namespace
  chart     = var.objects_chart

  values = [yamlencode({
    items = [
      {
        apiVersion = "monitoring.coreos.com/v1"
        kind       = "PrometheusRule"
        metadata   = { name = "fngate", labels = { "app.kubernetes.io/part-of" = "fngate" } }
        spec       = { groups = local.rules.groups }
      },
      {
        apiVersion = "monitoring.coreos.com/v1"
        kind       = "PodMonitor"
        metadata   = { name = "fngate", labels = { "app.kubernetes.io/part-of" = "fngate" } }
        spec = {
          namespaceSelector = { matchNames = [var.fngate_namespace] }
          selector          = { matchLabels = { "app.kubernetes.io/name" = "fngate" } }
          podMetricsEndpoints = [
            {
              port          = "http"
              path          = "/metrics"
              authorization = { type = "Bearer", credentials = { name = local.metrics_key_secret, key = "key" } }
            },
            { port = "metrics", path = "/metrics" },
          ]
        }
      },
    ]
  })]

  # The CRDs come with kube-prometheus-stack; fngate_namespace is module.fngate's output, so the
  # namespace exists first.
  depends_on = [helm_release.prometheus]
}
