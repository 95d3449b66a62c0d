// Package k8s holds Capstan's Kubernetes manifests (kustomize: base/ and
// overlays/dev, overlays/prod) and, in k8s_test.go, the test that renders
// every overlay and checks it against the Kubernetes API types and against
// what the daemons read (internal/config). It has no Go code of its own.
package k8s
