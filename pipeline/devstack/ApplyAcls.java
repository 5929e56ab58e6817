// Creates the ACLs read from stdin with Kafka's own Admin client (run as a single-file source program:
// `java -cp '<kafka libs>/*' ApplyAcls.java <bootstrap> <client.properties>`). aiokafka has no ACL API,
// and Kafka's AclCommand lives in a jar the devstack does not fetch. One line per binding:
// principal|resourceType|patternType|resourceName|operation   (e.g. User:router|TOPIC|LITERAL|sluice.admission.v1|READ)
// Creating an ACL that exists is a no-op, so applying the table twice is safe.

import java.io.BufferedReader;
import java.io.FileInputStream;
import java.io.InputStreamReader;
import java.util.ArrayList;
import java.util.List;
import java.util.Properties;

import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.clients.admin.AdminClientConfig;
import org.apache.kafka.common.acl.AccessControlEntry;
import org.apache.kafka.common.acl.AclBinding;
import org.apache.kafka.common.acl.AclOperation;
import org.apache.kafka.common.acl.AclPermissionType;
import org.apache.kafka.common.resource.PatternType;
import org.apache.kafka.common.resource.ResourcePattern;
import org.apache.kafka.common.resource.ResourceType;

public class ApplyAcls {
    public static void main(String[] args) throws Exception {
        Properties props = new Properties();
        try (FileInputStream in = new FileInputStream(args[1])) {
            props.load(in);
        }
        props.put(AdminClientConfig.BOOTSTRAP_SERVERS_CONFIG, args[0]);
        List<AclBinding> bindings = new ArrayList<>();
        BufferedReader reader = new BufferedReader(new InputStreamReader(System.in));
        for (String line; (line = reader.readLine()) != null; ) {
            if (line.isBlank()) continue;
            String[] f = line.split("\\|", -1);
            bindings.add(new AclBinding(
                new ResourcePattern(ResourceType.valueOf(f[1]), f[3], PatternType.valueOf(f[2])),
                new AccessControlEntry(f[0], "*", AclOperation.valueOf(f[4]), AclPermissionType.ALLOW)));
        }
        try (Admin admin = Admin.create(props)) {
            admin.createAcls(bindings).all().get();
        }
        System.out.println("applied " + bindings.size() + " ACL bindings");
    }
}
