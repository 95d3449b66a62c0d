package ctl

import (
	"flag"
	"fmt"
	"io"
	"net/url"
	"os"
	"reflect"
	"strings"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/capstan-dev/capstan/internal/config"
)

// Masked replaces a secret's value in `config print`.
const Masked = "****"

// secretKeys are the configuration keys (last path element) whose values
// `config print` masks; database.url has only its password masked.
var secretKeys = map[string]bool{
	"callback_secret": true, // callback_secret
	"admin_token":     true, // gateway.admin_token
	"secret_key":      true, // router.secret_key
	"secret":          true, // capabilities[].await.secret
}

func configCmd(args []string, stdout io.Writer) error {
	if len(args) == 0 || args[0] != "print" {
		return fmt.Errorf("%w: config print [--config PATH]", ErrUsage)
	}
	fs := flag.NewFlagSet("config print", flag.ContinueOnError)
	path := fs.String("config", os.Getenv("CAPSTAN_CONFIG"), "configuration file (YAML); CAPSTAN_* variables override it (default $CAPSTAN_CONFIG)")
	if err := fs.Parse(args[1:]); err != nil {
		return fmt.Errorf("%w: %w", ErrUsage, err)
	}
	cfg, err := config.Load(*path)
	if err != nil {
		return fmt.Errorf("config: %w", err)
	}
	out, err := PrintConfig(cfg)
	if err != nil {
		return err
	}
	_, err = stdout.Write(out)
	return err
}

// PrintConfig renders cfg as YAML under its configuration keys, durations
// as Go durations ("1s"), with the secrets masked: callback_secret,
// gateway.admin_token, router.secret_key, capabilities[].await.secret and
// the password of database.url. Empty secrets stay empty.
func PrintConfig(cfg *config.Config) ([]byte, error) {
	m, _ := toPlain(reflect.ValueOf(cfg), "").(map[string]any)
	if db, ok := m["database"].(map[string]any); ok {
		if s, ok := db["url"].(string); ok {
			db["url"] = maskURL(s)
		}
	}
	b, err := yaml.Marshal(m)
	if err != nil {
		return nil, fmt.Errorf("config print: %w", err)
	}
	return b, nil
}

var durationType = reflect.TypeFor[time.Duration]()

// toPlain turns v into maps, slices and scalars keyed by the mapstructure
// tags, masking the values of secretKeys (key is v's own key).
func toPlain(v reflect.Value, key string) any {
	for v.Kind() == reflect.Pointer || v.Kind() == reflect.Interface {
		if v.IsNil() {
			return nil
		}
		v = v.Elem()
	}
	if v.Type() == durationType {
		return time.Duration(v.Int()).String()
	}
	switch v.Kind() {
	case reflect.Struct:
		m := map[string]any{}
		for i := range v.NumField() {
			f := v.Type().Field(i)
			if !f.IsExported() {
				continue
			}
			name, _, _ := strings.Cut(f.Tag.Get("mapstructure"), ",")
			if name == "-" {
				continue
			}
			if name == "" {
				name = strings.ToLower(f.Name)
			}
			m[name] = toPlain(v.Field(i), name)
		}
		return m
	case reflect.Slice, reflect.Array:
		if v.Kind() == reflect.Slice && v.IsNil() {
			return []any{}
		}
		out := make([]any, v.Len())
		for i := range v.Len() {
			out[i] = toPlain(v.Index(i), key)
		}
		return out
	case reflect.Map:
		m := map[string]any{}
		for _, k := range v.MapKeys() {
			ks := fmt.Sprint(k.Interface())
			m[ks] = toPlain(v.MapIndex(k), ks)
		}
		return m
	case reflect.String:
		if secretKeys[key] && v.String() != "" {
			return Masked
		}
		return v.String()
	default:
		return v.Interface()
	}
}

// maskURL masks the password of a libpq URL, in its user info or its
// password query parameter; a string that does not parse is masked whole.
func maskURL(s string) string {
	if s == "" {
		return s
	}
	u, err := url.Parse(s)
	if err != nil {
		return Masked
	}
	if _, ok := u.User.Password(); ok {
		u.User = url.UserPassword(u.User.Username(), Masked)
	}
	if q := u.Query(); q.Has("password") {
		q.Set("password", Masked)
		u.RawQuery = q.Encode()
	}
	return strings.ReplaceAll(u.String(), url.QueryEscape(Masked), Masked)
}
