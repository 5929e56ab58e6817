// Creates SCRAM users and ACLs read from stdin with Kafka's own Admin client (run as a single-file source
// program: `java -cp '<kafka libs>/*' ApplyAcls.java <bootstrap> <client.properties>`). aiokafka has no ACL
// or SCRAM API, and Kafka's AclCommand lives in a jar the devstack does not fetch. One line per item:
//   SCRAM-SHA-512|name|password                                  a SCRAM user, created or its password reset
//   principal|resourceType|patternType|resourceName|operation   an ACL binding
//                                                                (e.g. User:router|TOPIC|LITERAL|sluice.admission.v1|READ)
// Passwords come on stdin so that they never appear in a process's command line. Creating an ACL that exists
// is a no-op and upserting a user with its password again only re-salts it, so applying twice is safe.

import java.io.BufferedReader;
import java.io.FileInputStream;
import java.io.InputStreamReader;
import java.util.ArrayList;
import java.util.List;
import java.util.Properties;

import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.clients.admin.AdminClientConfig;
import org.apache.kafka.clients.admin.ScramCredentialInfo;
import org.apache.kafka.clients.admin.ScramMechanism;
import org.apache.kafka.clients.admin.UserScramCredentialAlteration;
import org.apache.kafka.clients.admin.UserScramCredentialUpsertion;
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
        List<UserScramCredentialAlteration> users = new ArrayList<>();
        BufferedReader reader = new BufferedReader(new InputStreamReader(System.in));
        for (String line; (line = reader.readLine()) != null; ) {
            if (line.isBlank()) continue;
            String[] f = line.split("\\|", -1);
            ScramMechanism mechanism = ScramMechanism.fromMechanismName(f[0]);
            if (mechanism != ScramMechanism.UNKNOWN) {
                users.add(new UserScramCredentialUpsertion(f[1], new ScramCredentialInfo(mechanism, 8192), f[2]));
                continue;
            }
            bindings.add(new AclBinding(
                new ResourcePattern(ResourceType.valueOf(f[1]), f[3], PatternType.valueOf(f[2])),
                new AccessControlEntry(f[0], "*", AclOperation.valueOf(f[4]), AclPermissionType.ALLOW)));
        }
        try (Admin admin = Admin.create(props)) {
            if (!users.isEmpty()) admin.alterUserScramCredentials(users).all().get();
            if (!bindings.isEmpty()) admin.createAcls(bindings).all().get();
        }
        System.out.println("applied " + users.size() + " SCRAM users and " + bindings.size() + " ACL bindings");
    }
}
