package metrics

import (
	"os"
	"regexp"
	"sort"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// registeredNames lists the names of the ftkit_ metrics an agent's registry serves.
func registeredNames(t *testing.T) map[string]bool {
	ch := make(chan *prometheus.Desc, 256)
	for _, c := range New(&fakeSource{}).own {
		c.Describe(ch)
	}
	close(ch)
	name := regexp.MustCompile(`fqName: "(ftkit_[a-z0-9_]+)"`)
	names := map[string]bool{}
	for d := range ch {
		if mm := name.FindStringSubmatch(d.String()); mm != nil {
			names[mm[1]] = true
		}
	}
	if len(names) < 40 {
		t.Fatalf("found only %d metrics: %v", len(names), names)
	}
	return names
}

// docs/operations.md's table of metrics lists every metric the agent serves, and only those.
func TestOperationsDocListsEveryMetric(t *testing.T) {
	doc, err := os.ReadFile("../docs/operations.md")
	if err != nil {
		t.Fatal(err)
	}
	code := registeredNames(t)
	documented := map[string]bool{}
	for _, n := range regexp.MustCompile(`ftkit_[a-z0-9_]+`).FindAllString(string(doc), -1) {
		documented[n] = true
	}
	var missing, unknown []string
	for n := range code {
		if !documented[n] {
			missing = append(missing, n)
		}
	}
	for n := range documented {
		base := n
		for _, s := range []string{"_sum", "_count", "_bucket"} {
			if b, ok := strings.CutSuffix(n, s); ok && code[b] {
				base = b
			}
		}
		if !code[base] {
			unknown = append(unknown, n)
		}
	}
	sort.Strings(missing)
	sort.Strings(unknown)
	if len(missing) > 0 {
		t.Errorf("metrics the agent serves that docs/operations.md does not document: %v", missing)
	}
	if len(unknown) > 0 {
		t.Errorf("metrics docs/operations.md names that the agent does not serve: %v", unknown)
	}
}
