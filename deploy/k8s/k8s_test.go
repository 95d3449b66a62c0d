package k8s_test

import (
	"encoding/base64"
	"encoding/json"
	"errors"
	"maps"
	"net"
	"net/url"
	"os"
	"path"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
	sigsjson "sigs.k8s.io/json"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
	"sigs.k8s.io/yaml"

	"github.com/capstan-dev/capstan/internal/config"
	"github.com/capstan-dev/capstan/internal/daemon"
)

// roles are the four daemons; each is a Deployment named capstan-<role>
// whose container runs /usr/local/bin/<role>.
var roles = []string{"gateway", "dispatcher", "consumer", "router"}

// binaries are the five programs in the image (Dockerfile: ./cmd/...).
var binaries = []string{"gateway", "dispatcher", "consumer", "router", "capstanctl"}

const (
	binDir       = "/usr/local/bin"
	configPath   = "/etc/capstan/capstan.yaml"
	configKey    = "capstan.yaml"
	nonRootUID   = 65532
	secretName   = "capstan-database" // key url: the libpq URL
	keysName     = "capstan-keys"     // router-secret-key, gateway-admin-token (optional)
	monitoringNS = "monitoring"
	repoRoot     = "../.."
)

// prometheusRule is the part of monitoring.coreos.com/v1 PrometheusRule that
// the base uses; decoding is strict, so a misspelt field fails.
type prometheusRule struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              struct {
		Groups []struct {
			Name     string `json:"name"`
			Interval string `json:"interval,omitempty"`
			Rules    []struct {
				Alert         string            `json:"alert,omitempty"`
				Record        string            `json:"record,omitempty"`
				Expr          string            `json:"expr"`
				For           string            `json:"for,omitempty"`
				KeepFiringFor string            `json:"keep_firing_for,omitempty"`
				Labels        map[string]string `json:"labels,omitempty"`
				Annotations   map[string]string `json:"annotations,omitempty"`
			} `json:"rules"`
		} `json:"groups"`
	} `json:"spec"`
}

// manifests is one rendered overlay, decoded strictly into API types.
type manifests struct {
	deployments     map[string]*appsv1.Deployment
	services        map[string]*corev1.Service
	configMaps      map[string]*corev1.ConfigMap
	secrets         map[string]*corev1.Secret
	serviceAccounts map[string]*corev1.ServiceAccount
	namespaces      map[string]*corev1.Namespace
	jobs            map[string]*batchv1.Job
	hpas            map[string]*autoscalingv2.HorizontalPodAutoscaler
	pdbs            map[string]*policyv1.PodDisruptionBudget
	netpols         map[string]*networkingv1.NetworkPolicy
	rules           map[string]*prometheusRule
}

// decodeStrict decodes JSON into v as the API server's strict field
// validation does: field names match case-sensitively, and an unknown or
// duplicated field is an error (encoding/json's DisallowUnknownFields alone
// would accept "ReadinessProbe" for "readinessProbe").
func decodeStrict(data []byte, v any) error {
	strict, err := sigsjson.UnmarshalStrict(data, v)
	if err != nil {
		return err
	}
	return errors.Join(strict...)
}

func add[T any](t *testing.T, m map[string]*T, name string, data []byte) {
	t.Helper()
	v := new(T)
	if err := decodeStrict(data, v); err != nil {
		t.Fatalf("%s: strict decode as %T: %v\n%s", name, v, err, data)
	}
	if _, dup := m[name]; dup {
		t.Fatalf("%s: rendered twice", name)
	}
	m[name] = v
}

// render builds the kustomization in dir and decodes every object.
func render(t *testing.T, dir string) *manifests {
	t.Helper()
	opts := krusty.MakeDefaultOptions()
	opts.Reorder = krusty.ReorderOptionLegacy // as kubectl kustomize / kubectl apply -k
	k := krusty.MakeKustomizer(opts)
	rm, err := k.Run(filesys.MakeFsOnDisk(), dir)
	if err != nil {
		t.Fatalf("kustomize build %s: %v", dir, err)
	}
	m := &manifests{
		deployments: map[string]*appsv1.Deployment{}, services: map[string]*corev1.Service{},
		configMaps: map[string]*corev1.ConfigMap{}, secrets: map[string]*corev1.Secret{},
		serviceAccounts: map[string]*corev1.ServiceAccount{}, namespaces: map[string]*corev1.Namespace{},
		jobs: map[string]*batchv1.Job{}, hpas: map[string]*autoscalingv2.HorizontalPodAutoscaler{},
		pdbs: map[string]*policyv1.PodDisruptionBudget{}, netpols: map[string]*networkingv1.NetworkPolicy{},
		rules: map[string]*prometheusRule{},
	}
	for _, r := range rm.Resources() {
		y, err := r.AsYAML()
		if err != nil {
			t.Fatal(err)
		}
		j, err := yaml.YAMLToJSON(y)
		if err != nil {
			t.Fatalf("%s: %v", r.CurId(), err)
		}
		var tm metav1.TypeMeta
		if err := json.Unmarshal(j, &tm); err != nil {
			t.Fatal(err)
		}
		name := r.GetName()
		switch tm.APIVersion + " " + tm.Kind {
		case "apps/v1 Deployment":
			add(t, m.deployments, name, j)
		case "v1 Service":
			add(t, m.services, name, j)
		case "v1 ConfigMap":
			add(t, m.configMaps, name, j)
		case "v1 Secret":
			add(t, m.secrets, name, j)
		case "v1 ServiceAccount":
			add(t, m.serviceAccounts, name, j)
		case "v1 Namespace":
			add(t, m.namespaces, name, j)
		case "batch/v1 Job":
			add(t, m.jobs, name, j)
		case "autoscaling/v2 HorizontalPodAutoscaler":
			add(t, m.hpas, name, j)
		case "policy/v1 PodDisruptionBudget":
			add(t, m.pdbs, name, j)
		case "networking.k8s.io/v1 NetworkPolicy":
			add(t, m.netpols, name, j)
		case "monitoring.coreos.com/v1 PrometheusRule":
			add(t, m.rules, name, j)
		default:
			t.Fatalf("%s: unexpected kind %s %s (teach this test to decode it strictly)", name, tm.APIVersion, tm.Kind)
		}
	}
	return m
}

// overlay describes what differs between the overlays.
type overlay struct {
	dir       string
	namespace string
	// secrets: the overlay generates the Secrets (else they come out of band).
	secrets bool
	// minReplicas, maxReplicas bound every HPA's range (0: unchecked).
	minFloor, maxCeiling int32
	// allowPrivate is router.allow_private_addresses after config.Load.
	allowPrivate bool
}

var overlays = []overlay{
	// The base alone: no namespace, no Secrets; its capstan.yaml is what
	// overlays start from, so it must load too.
	{dir: "base", secrets: false, minFloor: 1, allowPrivate: true},
	{dir: "overlays/dev", namespace: "capstan-dev", secrets: true, minFloor: 1, maxCeiling: 1, allowPrivate: true},
	{dir: "overlays/prod", namespace: "capstan", secrets: false, minFloor: 2, allowPrivate: false},
}

func TestOverlays(t *testing.T) {
	for _, o := range overlays {
		t.Run(path.Base(o.dir), func(t *testing.T) {
			m := render(t, o.dir)
			checkOverlay(t, o, m)
		})
	}
}

func checkOverlay(t *testing.T, o overlay, m *manifests) {
	// The expected objects, no more, no fewer.
	wantNames := func(kind string, got []string, want ...string) {
		t.Helper()
		slices.Sort(got)
		slices.Sort(want)
		if !slices.Equal(got, want) {
			t.Errorf("%s: got %v, want %v", kind, got, want)
		}
	}
	var daemons []string
	for _, r := range roles {
		daemons = append(daemons, "capstan-"+r)
	}
	keys := func(mp any) []string {
		var ks []string
		for _, k := range reflect.ValueOf(mp).MapKeys() {
			ks = append(ks, k.String())
		}
		return ks
	}
	wantNames("Deployment", keys(m.deployments), daemons...)
	wantNames("Service", keys(m.services), daemons...)
	wantNames("HorizontalPodAutoscaler", keys(m.hpas), daemons...)
	wantNames("PodDisruptionBudget", keys(m.pdbs), daemons...)
	wantNames("NetworkPolicy", keys(m.netpols), append(slices.Clone(daemons), "capstan-migrate")...)
	wantNames("Job", keys(m.jobs), "capstan-migrate")
	wantNames("ServiceAccount", keys(m.serviceAccounts), "capstan")
	if o.namespace != "" {
		wantNames("Namespace", keys(m.namespaces), o.namespace)
	} else {
		wantNames("Namespace", keys(m.namespaces))
	}
	wantNames("PrometheusRule", keys(m.rules), "capstan")
	if len(m.configMaps) != 1 {
		t.Fatalf("want one ConfigMap (capstan-config-<hash>), got %v", keys(m.configMaps))
	}
	// secretNames maps each Secret the pods use to its rendered name.
	secretNames := map[string]string{secretName: secretName, keysName: keysName}
	if o.secrets {
		if len(m.secrets) != len(secretNames) {
			t.Fatalf("want the generated Secrets %s-<hash> and %s-<hash>, got %v", secretName, keysName, keys(m.secrets))
		}
		generated := map[string]string{}
		for base := range secretNames {
			for n := range m.secrets {
				if strings.HasPrefix(n, base+"-") {
					generated[base] = n
				}
			}
			if generated[base] == "" {
				t.Fatalf("no generated Secret %s-<hash> among %v", base, keys(m.secrets))
			}
		}
		secretNames = generated
	} else if len(m.secrets) != 0 {
		t.Fatalf("%s must not carry a Secret (it is supplied out of band), got %v", o.dir, keys(m.secrets))
	}
	for _, ns := range m.namespaces {
		if ns.Labels["pod-security.kubernetes.io/enforce"] != "restricted" {
			t.Errorf("namespace %s: want pod-security.kubernetes.io/enforce=restricted", ns.Name)
		}
	}
	checkNamespaced(t, o, m)

	var cm *corev1.ConfigMap
	for _, c := range m.configMaps {
		cm = c
	}
	if !strings.HasPrefix(cm.Name, "capstan-config-") {
		t.Errorf("ConfigMap %s: want the generated capstan-config-<hash>", cm.Name)
	}
	raw, ok := cm.Data[configKey]
	if !ok {
		t.Fatalf("ConfigMap %s has no %s", cm.Name, configKey)
	}
	cfgFile := filepath.Join(t.TempDir(), configKey)
	if err := os.WriteFile(cfgFile, []byte(raw), 0o600); err != nil {
		t.Fatal(err)
	}
	dbURL := "postgres://capstan@db.invalid:5432/capstan"
	if s := m.secrets[secretNames[secretName]]; s != nil {
		if dbURL = secretValue(s, "url"); dbURL == "" {
			t.Fatalf("Secret %s has no url", s.Name)
		}
	}

	// The configuration as each daemon loads it: the ConfigMap's file and
	// the container's environment (the Secret's value, or a stand-in).
	cfgs := map[string]*config.Config{}
	for _, role := range roles {
		d := m.deployments["capstan-"+role]
		if d == nil || len(d.Spec.Template.Spec.Containers) == 0 {
			continue
		}
		t.Run("config/"+role, func(t *testing.T) {
			cfgs[role] = loadConfig(t, cfgFile, d.Spec.Template.Spec.Containers[0], m, dbURL)
		})
	}
	cfg := cfgs["gateway"]
	if cfg == nil {
		t.Fatal("the gateway's configuration did not load")
	}
	var doc struct {
		Database map[string]any `json:"database"`
	}
	if err := yaml.Unmarshal([]byte(raw), &doc); err != nil {
		t.Fatalf("%s: %v", configKey, err)
	}
	if _, ok := doc.Database["url"]; ok {
		t.Errorf("%s must not hold database.url: the Secret supplies it", configKey)
	}
	if cfg.Database.MigrateOnStart {
		t.Errorf("database.migrate_on_start: want false, the migration Job migrates")
	}
	if cfg.Router.AllowPrivateAddresses != o.allowPrivate {
		t.Errorf("router.allow_private_addresses = %v, want %v", cfg.Router.AllowPrivateAddresses, o.allowPrivate)
	}
	if !o.allowPrivate && !regexp.MustCompile(`(?m)^\s+allow_private_addresses:\s*false\b`).MatchString(raw) {
		t.Errorf("%s: router.allow_private_addresses: false must be explicit", configKey)
	}

	adminPort := map[string]int32{
		"gateway":    listenPort(t, "gateway.admin_listen", cfg.Gateway.AdminListen),
		"dispatcher": listenPort(t, "dispatcher.admin_listen", cfg.Dispatcher.AdminListen),
		"consumer":   listenPort(t, "consumer.admin_listen", cfg.Consumer.AdminListen),
		"router":     listenPort(t, "router.admin_listen", cfg.Router.AdminListen),
	}
	grpcPort := map[string]int32{
		"gateway":    listenPort(t, "gateway.listen", cfg.Gateway.Listen),
		"dispatcher": listenPort(t, "dispatcher.listen", cfg.Dispatcher.Listen),
	}

	var image string
	for _, role := range roles {
		d := m.deployments["capstan-"+role]
		if d == nil {
			continue
		}
		t.Run("deployment/"+role, func(t *testing.T) {
			if cfgs[role] == nil {
				t.Fatalf("the %s configuration did not load", role)
			}
			checkDeployment(t, role, d, cfgs[role], cm.Name, secretNames, adminPort[role], grpcPort[role])
			if c := d.Spec.Template.Spec.Containers; len(c) > 0 {
				if image == "" {
					image = c[0].Image
				} else if c[0].Image != image {
					t.Errorf("image %s differs from %s: one image serves every role", c[0].Image, image)
				}
			}
		})
	}

	t.Run("services", func(t *testing.T) { checkServices(t, m) })
	t.Run("nudge-address", func(t *testing.T) {
		host, port, err := net.SplitHostPort(cfg.Gateway.DispatcherAddr)
		if err != nil {
			t.Fatalf("gateway.dispatcher_addr %q: %v", cfg.Gateway.DispatcherAddr, err)
		}
		host, _, _ = strings.Cut(host, ".") // capstan-dispatcher[.namespace.svc…]
		svc := m.services[host]
		if svc == nil || svc.Name != "capstan-dispatcher" {
			t.Fatalf("gateway.dispatcher_addr %q: want the capstan-dispatcher Service", cfg.Gateway.DispatcherAddr)
		}
		if p := servicePort(svc, "grpc"); p == nil || strconv.Itoa(int(p.Port)) != port || p.Port != grpcPort["dispatcher"] {
			t.Errorf("gateway.dispatcher_addr %q: want port %d (dispatcher.listen, the Service's grpc port)",
				cfg.Gateway.DispatcherAddr, grpcPort["dispatcher"])
		}
	})
	t.Run("autoscalers", func(t *testing.T) { checkHPAs(t, o, m, cfg) })
	t.Run("disruption-budgets", func(t *testing.T) { checkPDBs(t, m) })
	t.Run("migration-job", func(t *testing.T) { checkJob(t, m, image, secretNames[secretName]) })
	t.Run("network-policies", func(t *testing.T) { checkNetworkPolicies(t, m, cfg, dbURL, grpcPort) })
	t.Run("alerts", func(t *testing.T) { checkAlerts(t, m) })
}

// checkNamespaced: every namespaced object lands in the overlay's namespace
// and carries the app.kubernetes.io labels.
func checkNamespaced(t *testing.T, o overlay, m *manifests) {
	t.Helper()
	var metas []*metav1.ObjectMeta
	for _, v := range m.deployments {
		metas = append(metas, &v.ObjectMeta)
	}
	for _, v := range m.services {
		metas = append(metas, &v.ObjectMeta)
	}
	for _, v := range m.configMaps {
		metas = append(metas, &v.ObjectMeta)
	}
	for _, v := range m.secrets {
		metas = append(metas, &v.ObjectMeta)
	}
	for _, v := range m.serviceAccounts {
		metas = append(metas, &v.ObjectMeta)
	}
	for _, v := range m.jobs {
		metas = append(metas, &v.ObjectMeta)
	}
	for _, v := range m.hpas {
		metas = append(metas, &v.ObjectMeta)
	}
	for _, v := range m.pdbs {
		metas = append(metas, &v.ObjectMeta)
	}
	for _, v := range m.netpols {
		metas = append(metas, &v.ObjectMeta)
	}
	for _, v := range m.rules {
		metas = append(metas, &v.ObjectMeta)
	}
	for _, md := range metas {
		if md.Namespace != o.namespace {
			t.Errorf("%s: namespace %q, want %q", md.Name, md.Namespace, o.namespace)
		}
		if md.Labels["app.kubernetes.io/part-of"] != "capstan" || (o.namespace != "" && md.Labels["app.kubernetes.io/instance"] == "") {
			t.Errorf("%s: want app.kubernetes.io/part-of=capstan and app.kubernetes.io/instance labels, got %v", md.Name, md.Labels)
		}
	}
}

// standIns are values for Secrets an overlay does not carry, of the shape
// the production Secrets must have.
func standIns(dbURL string) map[string]string {
	return map[string]string{
		"CAPSTAN_DATABASE_URL":        dbURL,
		"CAPSTAN_ROUTER_SECRET_KEY":   base64.StdEncoding.EncodeToString(make([]byte, 32)),
		"CAPSTAN_GATEWAY_ADMIN_TOKEN": strings.Repeat("t", 24),
	}
}

func secretValue(s *corev1.Secret, key string) string {
	if v, ok := s.StringData[key]; ok {
		return v
	}
	return string(s.Data[key]) // []byte fields are base64 in JSON; decoded already
}

// configKeys lists every dotted key of config.Config (mapstructure tags).
func configKeys() map[string]bool {
	keys := map[string]bool{}
	var walk func(prefix string, typ reflect.Type)
	walk = func(prefix string, typ reflect.Type) {
		for f := range typ.Fields() {
			tag := strings.Split(f.Tag.Get("mapstructure"), ",")[0]
			if tag == "" {
				continue
			}
			k := prefix + tag
			keys[k] = true
			if f.Type.Kind() == reflect.Struct && f.Type != reflect.TypeFor[time.Duration]() {
				walk(k+".", f.Type)
			}
		}
	}
	walk("", reflect.TypeFor[config.Config]())
	return keys
}

// loadConfig runs config.Load on the ConfigMap's file with the container's
// environment, as the daemon would.
func loadConfig(t *testing.T, file string, c corev1.Container, m *manifests, dbURL string) *config.Config {
	t.Helper()
	// Nothing from the outer environment may leak into config.Load.
	for _, kv := range os.Environ() {
		name, _, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(name, "CAPSTAN_") || name == "DATABASE_URL" || name == "KAFKA_BROKERS" {
			t.Setenv(name, "")
		}
	}
	known := configKeys()
	sawDB := false
	for _, e := range c.Env {
		if strings.HasPrefix(e.Name, "CAPSTAN_") && e.Name != "CAPSTAN_CONFIG" {
			key := strings.ToLower(strings.TrimPrefix(e.Name, "CAPSTAN_"))
			found := false
			for k := range known {
				if strings.ReplaceAll(k, ".", "_") == key {
					found = true
				}
			}
			if !found {
				t.Errorf("env %s maps to no configuration key", e.Name)
			}
		}
		switch {
		case e.ValueFrom == nil:
			t.Setenv(e.Name, e.Value)
		case e.ValueFrom.SecretKeyRef != nil:
			ref := e.ValueFrom.SecretKeyRef
			if e.Name == "CAPSTAN_DATABASE_URL" && ref.Key == "url" {
				sawDB = true
			}
			optional := ref.Optional != nil && *ref.Optional
			if s := m.secrets[ref.Name]; s != nil {
				v := secretValue(s, ref.Key)
				if v == "" && !optional {
					t.Errorf("env %s: Secret %s has no %s", e.Name, ref.Name, ref.Key)
				}
				t.Setenv(e.Name, v)
			} else if v, ok := standIns(dbURL)[e.Name]; ok {
				t.Setenv(e.Name, v)
			} else if !optional {
				t.Errorf("env %s: no stand-in for the out-of-band Secret %s/%s", e.Name, ref.Name, ref.Key)
			}
		case e.ValueFrom.FieldRef != nil:
			t.Setenv(e.Name, "pod-"+strings.ReplaceAll(e.ValueFrom.FieldRef.FieldPath, ".", "-"))
		default:
			t.Errorf("env %s: unsupported valueFrom", e.Name)
		}
	}
	if !sawDB {
		t.Errorf("container %s: want CAPSTAN_DATABASE_URL from secretKeyRef %s/url", c.Name, secretName)
	}
	cfg, err := config.Load(file)
	if err != nil {
		t.Fatalf("config.Load(%s) as container %s: %v", configKey, c.Name, err)
	}
	return cfg
}

func listenPort(t *testing.T, key, addr string) int32 {
	t.Helper()
	_, p, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatalf("%s %q: %v", key, addr, err)
	}
	n, err := strconv.ParseInt(p, 10, 32)
	if err != nil || n <= 0 {
		t.Fatalf("%s %q: want a fixed port", key, addr)
	}
	return int32(n)
}

// resolvePort maps a probe or Service target port to a container port number.
func resolvePort(c corev1.Container, p intstr.IntOrString) (int32, string, bool) {
	for _, cp := range c.Ports {
		if (p.Type == intstr.String && cp.Name == p.StrVal) || (p.Type == intstr.Int && cp.ContainerPort == p.IntVal) {
			return cp.ContainerPort, cp.Name, true
		}
	}
	return 0, "", false
}

func containerPort(c corev1.Container, name string) *corev1.ContainerPort {
	for i := range c.Ports {
		if c.Ports[i].Name == name {
			return &c.Ports[i]
		}
	}
	return nil
}

func servicePort(s *corev1.Service, name string) *corev1.ServicePort {
	for i := range s.Spec.Ports {
		if s.Spec.Ports[i].Name == name {
			return &s.Spec.Ports[i]
		}
	}
	return nil
}

func checkSecurity(t *testing.T, what string, pod corev1.PodSpec, c corev1.Container) {
	t.Helper()
	ps := pod.SecurityContext
	if ps == nil || ps.RunAsNonRoot == nil || !*ps.RunAsNonRoot || ps.RunAsUser == nil || *ps.RunAsUser != nonRootUID ||
		ps.SeccompProfile == nil || ps.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Errorf("%s: pod securityContext: want runAsNonRoot, runAsUser %d, seccomp RuntimeDefault", what, nonRootUID)
	}
	sc := c.SecurityContext
	if sc == nil {
		t.Fatalf("%s: container %s has no securityContext", what, c.Name)
	}
	switch {
	case sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot:
		t.Errorf("%s: runAsNonRoot must be true", what)
	case sc.RunAsUser == nil || *sc.RunAsUser != nonRootUID:
		t.Errorf("%s: runAsUser must be %d", what, nonRootUID)
	case sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem:
		t.Errorf("%s: readOnlyRootFilesystem must be true", what)
	case sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation:
		t.Errorf("%s: allowPrivilegeEscalation must be false", what)
	case sc.Capabilities == nil || !slices.Contains(sc.Capabilities.Drop, "ALL") || len(sc.Capabilities.Add) > 0:
		t.Errorf("%s: capabilities must drop ALL and add none", what)
	case sc.SeccompProfile == nil || sc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault:
		t.Errorf("%s: seccompProfile must be RuntimeDefault", what)
	case sc.Privileged != nil && *sc.Privileged:
		t.Errorf("%s: must not be privileged", what)
	}
	if pod.AutomountServiceAccountToken == nil || *pod.AutomountServiceAccountToken {
		t.Errorf("%s: automountServiceAccountToken must be false", what)
	}
	if pod.HostNetwork || pod.HostPID || pod.HostIPC {
		t.Errorf("%s: must not use host namespaces", what)
	}
}

func checkResources(t *testing.T, what string, r corev1.ResourceRequirements) {
	t.Helper()
	for _, name := range []corev1.ResourceName{corev1.ResourceCPU, corev1.ResourceMemory} {
		req, okReq := r.Requests[name]
		lim, okLim := r.Limits[name]
		if !okReq || !okLim || req.IsZero() || lim.IsZero() {
			t.Errorf("%s: want %s request and limit, got requests %v limits %v", what, name, r.Requests, r.Limits)
			continue
		}
		if req.Cmp(lim) > 0 {
			t.Errorf("%s: %s request %s exceeds its limit %s", what, name, req.String(), lim.String())
		}
	}
}

// checkCommand: the container runs one of the image's binaries, built from cmd/<name>.
func checkCommand(t *testing.T, what string, cmd []string, want string) {
	t.Helper()
	if len(cmd) == 0 {
		t.Fatalf("%s: no command", what)
	}
	dir, bin := path.Split(cmd[0])
	if path.Clean(dir) != binDir || !slices.Contains(binaries, bin) {
		t.Fatalf("%s: command %q is not one of %s/{%s}", what, cmd[0], binDir, strings.Join(binaries, ","))
	}
	if bin != want {
		t.Errorf("%s: runs %s, want %s", what, bin, want)
	}
	if st, err := os.Stat(filepath.Join(repoRoot, "cmd", bin)); err != nil || !st.IsDir() {
		t.Errorf("%s: cmd/%s does not exist", what, bin)
	}
}

func checkDeployment(t *testing.T, role string, d *appsv1.Deployment, cfg *config.Config,
	configMap string, secrets map[string]string, adminPort, grpcPort int32) {
	spec := d.Spec.Template.Spec
	if len(spec.Containers) != 1 {
		t.Fatalf("want one container, got %d", len(spec.Containers))
	}
	c := spec.Containers[0]
	if c.Name != role {
		t.Errorf("container name %q, want %q", c.Name, role)
	}
	checkCommand(t, d.Name, c.Command, role)
	if want := []string{"--config", configPath}; !slices.Equal(c.Args, want) {
		t.Errorf("args %q, want %q", c.Args, want)
	}
	if !strings.Contains(c.Image, "capstan") || !(strings.Contains(path.Base(c.Image), ":") || strings.Contains(c.Image, "@sha256:")) {
		t.Errorf("image %q: want the capstan image with a tag or digest", c.Image)
	}

	// Labels, selector and HPA ownership of the replica count.
	pl := d.Spec.Template.Labels
	for k, v := range map[string]string{
		"app.kubernetes.io/name": "capstan", "app.kubernetes.io/component": role, "app.kubernetes.io/part-of": "capstan",
	} {
		if pl[k] != v || d.Labels[k] != v {
			t.Errorf("label %s: want %q on the Deployment and its pods", k, v)
		}
	}
	sel, err := metav1.LabelSelectorAsSelector(d.Spec.Selector)
	if err != nil || !sel.Matches(labels.Set(pl)) {
		t.Errorf("selector %v does not match the pod labels %v", d.Spec.Selector, pl)
	}
	if d.Spec.Replicas != nil {
		t.Errorf("replicas is set (%d): the HorizontalPodAutoscaler owns the count", *d.Spec.Replicas)
	}

	// The config file comes from the generated ConfigMap at --config.
	var mountDir string
	for _, vm := range c.VolumeMounts {
		for _, v := range spec.Volumes {
			if v.Name == vm.Name && v.ConfigMap != nil && v.ConfigMap.Name == configMap {
				mountDir = vm.MountPath
			}
		}
	}
	if mountDir == "" || path.Join(mountDir, configKey) != configPath {
		t.Errorf("ConfigMap %s is not mounted so that %s exists (mounted at %q)", configMap, configPath, mountDir)
	}
	for _, e := range c.Env {
		if r := e.ValueFrom; r != nil && r.SecretKeyRef != nil && !slices.Contains(slices.Collect(maps.Values(secrets)), r.SecretKeyRef.Name) {
			t.Errorf("env %s refers to Secret %s, want one of %v", e.Name, r.SecretKeyRef.Name, secrets)
		}
	}
	if spec.ServiceAccountName != "capstan" {
		t.Errorf("serviceAccountName %q, want capstan", spec.ServiceAccountName)
	}

	// Ports and probes: the admin port is the daemon's admin_listen.
	admin := containerPort(c, "admin")
	if admin == nil || admin.ContainerPort != adminPort {
		t.Errorf("container port admin: want %d (%s.admin_listen)", adminPort, role)
	}
	if grpcPort != 0 {
		if g := containerPort(c, "grpc"); g == nil || g.ContainerPort != grpcPort {
			t.Errorf("container port grpc: want %d (%s.listen)", grpcPort, role)
		}
	} else if containerPort(c, "grpc") != nil {
		t.Errorf("%s serves no gRPC, yet declares a grpc port", role)
	}
	for _, p := range []struct {
		kind  string
		probe *corev1.Probe
		path  string
	}{{"liveness", c.LivenessProbe, "/healthz"}, {"readiness", c.ReadinessProbe, "/readyz"}} {
		if p.probe == nil || p.probe.HTTPGet == nil {
			t.Errorf("%s probe: want httpGet %s", p.kind, p.path)
			continue
		}
		if p.probe.HTTPGet.Path != p.path {
			t.Errorf("%s probe path %q, want %q", p.kind, p.probe.HTTPGet.Path, p.path)
		}
		n, name, ok := resolvePort(c, p.probe.HTTPGet.Port)
		if !ok || name != "admin" || n != adminPort {
			t.Errorf("%s probe port %s: want the port named admin (%d)", p.kind, p.probe.HTTPGet.Port.String(), adminPort)
		}
		if p.probe.TimeoutSeconds < 3 && p.kind == "readiness" {
			t.Errorf("readiness timeoutSeconds %d: /readyz may take 2s (its check's own timeout)", p.probe.TimeoutSeconds)
		}
	}

	checkResources(t, d.Name, c.Resources)
	checkSecurity(t, d.Name, spec, c)

	// Spread across zones and hosts.
	keys := map[string]bool{}
	for _, tsc := range spec.TopologySpreadConstraints {
		s, err := metav1.LabelSelectorAsSelector(tsc.LabelSelector)
		if err != nil || !s.Matches(labels.Set(pl)) {
			t.Errorf("topologySpreadConstraint %s: labelSelector does not select these pods", tsc.TopologyKey)
		}
		keys[tsc.TopologyKey] = true
	}
	if !keys["topology.kubernetes.io/zone"] || !keys["kubernetes.io/hostname"] {
		t.Errorf("topologySpreadConstraints: want zone and hostname, got %v", keys)
	}

	// Graceful drain fits in the grace period.
	if spec.TerminationGracePeriodSeconds == nil || *spec.TerminationGracePeriodSeconds < 30 {
		t.Fatalf("terminationGracePeriodSeconds: want ≥ 30")
	}
	grace := time.Duration(*spec.TerminationGracePeriodSeconds) * time.Second
	need := daemon.Grace
	if c.Lifecycle != nil && c.Lifecycle.PreStop != nil && c.Lifecycle.PreStop.Sleep != nil {
		need += time.Duration(c.Lifecycle.PreStop.Sleep.Seconds) * time.Second
	}
	switch role {
	case "router":
		need = max(need, cfg.Router.Timeout+daemon.Grace)
	case "consumer":
		// consumer.DrainTimeout, then the final offset commit (5s), then
		// the group leaves. (Not imported: it would pull the store and
		// Kafka packages into this test.)
		const drain, commit = 10 * time.Second, 5 * time.Second
		need = max(need, drain+commit+daemon.Grace)
	}
	if grace < need {
		t.Errorf("terminationGracePeriodSeconds %v is shorter than the drain (%v)", grace, need)
	}
}

func checkServices(t *testing.T, m *manifests) {
	for name, s := range m.services {
		sel := labels.SelectorFromSet(s.Spec.Selector)
		var target *appsv1.Deployment
		for _, d := range m.deployments {
			if len(s.Spec.Selector) > 0 && sel.Matches(labels.Set(d.Spec.Template.Labels)) {
				if target != nil {
					t.Errorf("Service %s selects both %s and %s", name, target.Name, d.Name)
				}
				target = d
			}
		}
		if target == nil || target.Name != name {
			t.Errorf("Service %s must select the pods of Deployment %s", name, name)
			continue
		}
		c := target.Spec.Template.Spec.Containers[0]
		if len(s.Spec.Ports) != len(c.Ports) {
			t.Errorf("Service %s exposes %d ports, the container declares %d", name, len(s.Spec.Ports), len(c.Ports))
		}
		for _, p := range s.Spec.Ports {
			n, cname, ok := resolvePort(c, p.TargetPort)
			if !ok {
				t.Errorf("Service %s port %s: targetPort %s matches no container port", name, p.Name, p.TargetPort.String())
				continue
			}
			if p.Port != n || p.Name != cname {
				t.Errorf("Service %s port %s %d → %s: want the container port %s %d", name, p.Name, p.Port, p.TargetPort.String(), cname, n)
			}
		}
	}
	if servicePort(m.services["capstan-gateway"], "grpc") == nil || servicePort(m.services["capstan-dispatcher"], "grpc") == nil {
		t.Errorf("the gateway and dispatcher Services must expose grpc")
	}
	for _, s := range m.services {
		if servicePort(s, "admin") == nil {
			t.Errorf("Service %s must expose admin (metrics, health)", s.Name)
		}
	}
}

func checkHPAs(t *testing.T, o overlay, m *manifests, cfg *config.Config) {
	for name, h := range m.hpas {
		ref := h.Spec.ScaleTargetRef
		if ref.APIVersion != "apps/v1" || ref.Kind != "Deployment" || m.deployments[ref.Name] == nil {
			t.Errorf("HPA %s targets %s %s %s, which is not rendered", name, ref.APIVersion, ref.Kind, ref.Name)
		}
		if h.Spec.MinReplicas == nil || *h.Spec.MinReplicas < 1 || h.Spec.MaxReplicas < *h.Spec.MinReplicas {
			t.Errorf("HPA %s: want 1 ≤ minReplicas ≤ maxReplicas", name)
			continue
		}
		if *h.Spec.MinReplicas < o.minFloor {
			t.Errorf("HPA %s: minReplicas %d, want ≥ %d in %s", name, *h.Spec.MinReplicas, o.minFloor, o.dir)
		}
		if o.maxCeiling > 0 && h.Spec.MaxReplicas > o.maxCeiling {
			t.Errorf("HPA %s: maxReplicas %d, want ≤ %d in %s", name, h.Spec.MaxReplicas, o.maxCeiling, o.dir)
		}
		if len(h.Spec.Metrics) == 0 {
			t.Errorf("HPA %s has no metrics", name)
		}
		for _, mt := range h.Spec.Metrics {
			if mt.Type == autoscalingv2.ResourceMetricSourceType && mt.Resource != nil {
				d := m.deployments[ref.Name]
				if d != nil {
					if _, ok := d.Spec.Template.Spec.Containers[0].Resources.Requests[mt.Resource.Name]; !ok {
						t.Errorf("HPA %s scales on %s utilisation, but %s requests none", name, mt.Resource.Name, ref.Name)
					}
				}
			}
		}
	}
	if h := m.hpas["capstan-consumer"]; h != nil && h.Spec.MaxReplicas > cfg.Kafka.ExecutionPartitions {
		t.Errorf("HPA capstan-consumer: maxReplicas %d exceeds kafka.execution_partitions %d (idle consumers)",
			h.Spec.MaxReplicas, cfg.Kafka.ExecutionPartitions)
	}
}

func checkPDBs(t *testing.T, m *manifests) {
	covered := map[string]int{}
	for name, p := range m.pdbs {
		if p.Spec.MinAvailable == nil && p.Spec.MaxUnavailable == nil {
			t.Errorf("PDB %s sets neither minAvailable nor maxUnavailable", name)
		}
		sel, err := metav1.LabelSelectorAsSelector(p.Spec.Selector)
		if err != nil || sel.Empty() {
			t.Errorf("PDB %s: bad selector", name)
			continue
		}
		for dn, d := range m.deployments {
			if sel.Matches(labels.Set(d.Spec.Template.Labels)) {
				covered[dn]++
			}
		}
	}
	for dn := range m.deployments {
		if covered[dn] != 1 {
			t.Errorf("Deployment %s is covered by %d PodDisruptionBudgets, want 1", dn, covered[dn])
		}
	}
}

func checkJob(t *testing.T, m *manifests, image, secret string) {
	j := m.jobs["capstan-migrate"]
	if j == nil {
		t.Fatal("no migration Job")
	}
	spec := j.Spec.Template.Spec
	if len(spec.Containers) != 1 {
		t.Fatalf("want one container, got %d", len(spec.Containers))
	}
	c := spec.Containers[0]
	checkCommand(t, j.Name, c.Command, "capstanctl")
	if argv := append(slices.Clone(c.Command[1:]), c.Args...); !slices.Equal(argv, []string{"migrate"}) {
		t.Errorf("runs capstanctl %q, want capstanctl migrate", argv)
	}
	if c.Image != image {
		t.Errorf("image %s, want the daemons' %s (same schema version)", c.Image, image)
	}
	var db bool
	for _, e := range c.Env {
		if e.Name == "DATABASE_URL" && e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil &&
			e.ValueFrom.SecretKeyRef.Name == secret && e.ValueFrom.SecretKeyRef.Key == "url" {
			db = true
		}
	}
	if !db {
		t.Errorf("want DATABASE_URL (what capstanctl reads) from secretKeyRef %s/url", secret)
	}
	if spec.RestartPolicy != corev1.RestartPolicyNever && spec.RestartPolicy != corev1.RestartPolicyOnFailure {
		t.Errorf("restartPolicy %q", spec.RestartPolicy)
	}
	if j.Spec.BackoffLimit == nil || j.Spec.ActiveDeadlineSeconds == nil {
		t.Errorf("want backoffLimit and activeDeadlineSeconds")
	}
	checkResources(t, j.Name, c.Resources)
	checkSecurity(t, j.Name, spec, c)
}

// podsOf returns the names of the workloads whose pods sel selects.
func podsOf(m *manifests, sel labels.Selector) []string {
	var out []string
	for n, d := range m.deployments {
		if sel.Matches(labels.Set(d.Spec.Template.Labels)) {
			out = append(out, n)
		}
	}
	for n, j := range m.jobs {
		if sel.Matches(labels.Set(j.Spec.Template.Labels)) {
			out = append(out, n)
		}
	}
	slices.Sort(out)
	return out
}

func containerOf(m *manifests, name string) corev1.Container {
	if d := m.deployments[name]; d != nil {
		return d.Spec.Template.Spec.Containers[0]
	}
	return m.jobs[name].Spec.Template.Spec.Containers[0]
}

// egressAllows reports whether some egress rule allows proto/port to any
// destination (no "to") or to pods selected by peerPods.
func egressAllows(np *networkingv1.NetworkPolicy, proto corev1.Protocol, port int32, peer func(networkingv1.NetworkPolicyPeer) bool) bool {
	for _, r := range np.Spec.Egress {
		portOK := len(r.Ports) == 0
		for _, p := range r.Ports {
			pr := corev1.ProtocolTCP
			if p.Protocol != nil {
				pr = *p.Protocol
			}
			if pr == proto && p.Port != nil && p.Port.Type == intstr.Int && p.Port.IntVal == port {
				portOK = true
			}
		}
		if !portOK {
			continue
		}
		if len(r.To) == 0 {
			return true
		}
		for _, to := range r.To {
			if peer != nil && peer(to) {
				return true
			}
		}
	}
	return false
}

func urlPort(t *testing.T, what, raw, def string) int32 {
	t.Helper()
	u, err := url.Parse(raw)
	if err != nil {
		t.Fatalf("%s %q: %v", what, raw, err)
	}
	p := u.Port()
	if p == "" {
		p = def
	}
	n, err := strconv.Atoi(p)
	if err != nil {
		t.Fatalf("%s %q: port %q", what, raw, p)
	}
	return int32(n)
}

func checkNetworkPolicies(t *testing.T, m *manifests, cfg *config.Config, dbURL string, grpcPort map[string]int32) {
	pgPort := urlPort(t, "database url", dbURL, "5432")
	kafkaPorts := map[int32]bool{}
	for _, b := range cfg.Kafka.Brokers {
		_, p, err := net.SplitHostPort(b)
		if err != nil {
			t.Fatalf("kafka.brokers %q: %v", b, err)
		}
		n, _ := strconv.Atoi(p)
		kafkaPorts[int32(n)] = true
	}
	gatewayPods := func(peer networkingv1.NetworkPolicyPeer) bool {
		if peer.PodSelector == nil || peer.NamespaceSelector != nil || peer.IPBlock != nil {
			return false
		}
		s, err := metav1.LabelSelectorAsSelector(peer.PodSelector)
		return err == nil && slices.Equal(podsOf(m, s), []string{"capstan-gateway"})
	}
	for name, np := range m.netpols {
		sel, err := metav1.LabelSelectorAsSelector(&np.Spec.PodSelector)
		if err != nil || sel.Empty() {
			t.Errorf("NetworkPolicy %s: bad or empty podSelector", name)
			continue
		}
		if got := podsOf(m, sel); !slices.Equal(got, []string{name}) {
			t.Errorf("NetworkPolicy %s selects %v, want exactly %s", name, got, name)
			continue
		}
		if !slices.Contains(np.Spec.PolicyTypes, networkingv1.PolicyTypeIngress) ||
			!slices.Contains(np.Spec.PolicyTypes, networkingv1.PolicyTypeEgress) {
			t.Errorf("NetworkPolicy %s: want policyTypes Ingress and Egress", name)
		}
		c := containerOf(m, name)
		role := strings.TrimPrefix(name, "capstan-")

		// Ingress: every port exists on the pods; gRPC of the dispatcher
		// from gateway pods only; admin from the monitoring namespace.
		adminFromMonitoring := false
		for _, r := range np.Spec.Ingress {
			for _, p := range r.Ports {
				if p.Port == nil {
					t.Errorf("NetworkPolicy %s: an ingress rule allows every port", name)
					continue
				}
				_, pname, ok := resolvePort(c, *p.Port)
				if !ok {
					t.Errorf("NetworkPolicy %s: ingress port %s is not a port of %s", name, p.Port.String(), name)
				}
				if len(r.From) == 0 {
					t.Errorf("NetworkPolicy %s: ingress to %s from anywhere", name, pname)
				}
				switch pname {
				case "admin":
					for _, f := range r.From {
						if f.NamespaceSelector != nil && f.NamespaceSelector.MatchLabels["kubernetes.io/metadata.name"] == monitoringNS &&
							f.PodSelector == nil {
							adminFromMonitoring = true
						} else {
							t.Errorf("NetworkPolicy %s: admin ingress from %+v, want only the %s namespace", name, f, monitoringNS)
						}
					}
				case "grpc":
					if role == "dispatcher" {
						for _, f := range r.From {
							if !gatewayPods(f) {
								t.Errorf("NetworkPolicy %s: dispatcher gRPC from %+v, want gateway pods only", name, f)
							}
						}
					}
				}
			}
			if len(r.Ports) == 0 {
				t.Errorf("NetworkPolicy %s: an ingress rule allows every port", name)
			}
		}
		if containerPort(c, "admin") != nil && !adminFromMonitoring {
			t.Errorf("NetworkPolicy %s: admin must be reachable from the %s namespace", name, monitoringNS)
		}
		if role == "migrate" && len(np.Spec.Ingress) != 0 {
			t.Errorf("NetworkPolicy %s: the migration Job takes no ingress", name)
		}

		// Egress: DNS and PostgreSQL for all; Kafka where a Kafka client runs.
		if !egressAllows(np, corev1.ProtocolUDP, 53, nil) || !egressAllows(np, corev1.ProtocolTCP, 53, nil) {
			t.Errorf("NetworkPolicy %s: want DNS egress (53/UDP and 53/TCP)", name)
		}
		if !egressAllows(np, corev1.ProtocolTCP, pgPort, nil) {
			t.Errorf("NetworkPolicy %s: want PostgreSQL egress (%d)", name, pgPort)
		}
		for p := range kafkaPorts {
			if (role == "dispatcher" || role == "consumer" || role == "router") && !egressAllows(np, corev1.ProtocolTCP, p, nil) {
				t.Errorf("NetworkPolicy %s: want Kafka egress (%d)", name, p)
			}
		}
		if role == "router" && !egressAllows(np, corev1.ProtocolTCP, 443, nil) {
			t.Errorf("NetworkPolicy %s: want HTTPS egress for webhooks", name)
		}
		if role == "consumer" && !egressAllows(np, corev1.ProtocolTCP, 443, nil) {
			t.Errorf("NetworkPolicy %s: want HTTPS egress for adapters and the webhook transport", name)
		}
		if role == "gateway" {
			dispatcherPods := func(peer networkingv1.NetworkPolicyPeer) bool {
				if peer.PodSelector == nil {
					return false
				}
				s, err := metav1.LabelSelectorAsSelector(peer.PodSelector)
				return err == nil && slices.Equal(podsOf(m, s), []string{"capstan-dispatcher"})
			}
			if !egressAllows(np, corev1.ProtocolTCP, grpcPort["dispatcher"], dispatcherPods) {
				t.Errorf("NetworkPolicy %s: want egress to the dispatcher's gRPC port %d", name, grpcPort["dispatcher"])
			}
		}
	}
}

// slug is GitHub's anchor for a Markdown heading.
func slug(heading string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(strings.TrimSpace(heading)) {
		switch {
		case r == ' ':
			b.WriteRune('-')
		case r == '-' || r == '_' || (r >= 'a' && r <= 'z') || (r >= '0' && r <= '9'):
			b.WriteRune(r)
		}
	}
	return b.String()
}

func checkAlerts(t *testing.T, m *manifests) {
	doc, err := os.ReadFile(filepath.Join(repoRoot, "docs", "operations.md"))
	if err != nil {
		t.Fatalf("the runbooks: %v", err)
	}
	anchors := map[string]bool{}
	for _, line := range strings.Split(string(doc), "\n") {
		if h, ok := strings.CutPrefix(line, "#"); ok {
			anchors[slug(strings.TrimLeft(h, "#"))] = true
		}
	}
	want := map[string]string{ // alert → metric it must watch
		"CapstanDispatcherSilent": "capstan_dispatcher_last_pass_timestamp_seconds",
		"CapstanConsumerLag":      "capstan_consumer_lag_records",
		"CapstanDeadEvents":       "capstan_router_events_dead_total",
		"CapstanLeaseReapSurge":   "capstan_consumer_lease_reaps_total",
		"CapstanDatabaseOutage":   "capstan_readyz_status",
	}
	seen := map[string]bool{}
	for _, pr := range m.rules {
		if len(pr.Spec.Groups) == 0 {
			t.Errorf("PrometheusRule %s has no groups", pr.Name)
		}
		for _, g := range pr.Spec.Groups {
			for _, r := range g.Rules {
				if r.Alert == "" {
					continue
				}
				seen[r.Alert] = true
				if metric, ok := want[r.Alert]; ok && !strings.Contains(r.Expr, metric) {
					t.Errorf("%s: expr does not use %s", r.Alert, metric)
				}
				if strings.TrimSpace(r.Expr) == "" || r.Labels["severity"] == "" || r.Annotations["summary"] == "" {
					t.Errorf("%s: want expr, a severity label and a summary", r.Alert)
				}
				if r.For != "" {
					if _, err := time.ParseDuration(r.For); err != nil {
						t.Errorf("%s: for %q: %v", r.Alert, r.For, err)
					}
				}
				_, anchor, ok := strings.Cut(r.Annotations["runbook_url"], "/docs/operations.md#")
				if !ok || !anchors[anchor] {
					t.Errorf("%s: runbook_url %q does not point at a heading of docs/operations.md", r.Alert, r.Annotations["runbook_url"])
				}
			}
		}
	}
	for a := range want {
		if !seen[a] {
			t.Errorf("alert %s is missing", a)
		}
	}
}

// TestDockerfile checks the image recipe against what the manifests run.
func TestDockerfile(t *testing.T) {
	df, err := os.ReadFile(filepath.Join(repoRoot, "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	s := string(df)
	for _, want := range []string{
		"FROM golang:${GO_VERSION} AS build", "ARG GO_VERSION=1.26",
		"FROM gcr.io/distroless/static-debian12:nonroot",
		"CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o /out/",
		"COPY --from=build /out/ " + binDir + "/",
		"USER 65532:65532",
	} {
		if !strings.Contains(s, want) {
			t.Errorf("Dockerfile lacks %q", want)
		}
	}
	for _, b := range binaries {
		if !regexp.MustCompile(`\./cmd/` + b + `(\s|$)`).MatchString(s) {
			t.Errorf("Dockerfile does not build ./cmd/%s", b)
		}
	}
	ig, err := os.ReadFile(filepath.Join(repoRoot, ".dockerignore"))
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(string(ig), "\n")
	for _, want := range []string{"bin/", "run/", ".tools/", ".git"} {
		if !slices.Contains(lines, want) {
			t.Errorf(".dockerignore lacks %s", want)
		}
	}
}
